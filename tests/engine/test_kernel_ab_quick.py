"""bench/kernel_ab.py --quick runs end to end (this tree's kernel against itself: no second
build) and prints its JSON line last, with both sides' figures and the ratios."""

from __future__ import annotations

import pytest

from pdserve.engine import cpu_kernel
from pdserve.testing.loopback import run_bench

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(cpu_kernel.load() is None, reason="no C++ compiler here"),
]


@pytest.mark.timeout(240)
def test_kernel_ab_quick() -> None:
    result = run_bench("kernel_ab.py", "--before", str(cpu_kernel.SOURCE), "--quick", timeout=200)
    assert result["model"] == "tiny-seed0" and result["batch"] == 4
    for side in ("before", "after"):
        assert result[side]["steps"] == 4
        assert result[side]["step_cpu_ms_median"] >= result[side]["kernel_cpu_ms_median"] > 0
    # Shape only (performance bounds stay in bench/): both ratios are the medians' ratio.
    for key in ("step", "kernel"):
        want = result["after"][f"{key}_cpu_ms_median"] / result["before"][f"{key}_cpu_ms_median"]
        assert result[f"{key}_after_over_before"] == pytest.approx(want, abs=1e-3)
