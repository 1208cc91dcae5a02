"""bench/engine_profile.py --quick: the step's CPU time split on the tiny preset (shape and
consistency only; the figures are in docs/performance.md)."""

from __future__ import annotations

import pytest

from pdserve.testing.loopback import run_bench

pytestmark = [pytest.mark.bench, pytest.mark.timeout(300)]

PARTS = {"lm_head", "linears", "attention", "other_ops", "sampler", "python"}


def test_engine_profile_quick() -> None:
    result = run_bench("engine_profile.py", "--quick", timeout=280)
    assert result["model"] == "tiny-seed0" and result["vocab"] == 3072
    for phase in ("prefill", "decode"):
        got = result[phase]
        assert got["steps"] >= 1 and got["step_cpu_ms_median"] > 0
        share = got["share"]
        assert set(share) == PARTS and all(v >= 0 for v in share.values())
        # The parts are disjoint slices of the step: they add up to it (rounding, and
        # "python" clamps at zero when the wrappers' own cost exceeds it).
        assert 0.9 <= sum(share.values()) <= 1.1, share
        assert share["linears"] > 0 and share["lm_head"] > 0 and share["attention"] > 0
    assert result["lm_head_alone_ms"]["decode_rows"] > 0
