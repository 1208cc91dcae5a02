"""bench/kv_tiers.py --quick: the four settings and the injected failure, shape only (no
performance bound: the figures are in docs/kv_tiers.md)."""

from __future__ import annotations

import pytest

from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(300)
def test_bench_quick() -> None:
    result = run_bench("kv_tiers.py", "--quick", "--threads", "1", timeout=280)
    assert result["working_set_x"] >= 10
    rows = [result[s] for s in ("off", "host", "disk", "shared", "shared_failed")]
    for row in rows:
        assert row["requests"] == 14 and row["ttft_p50_ms"] > 0
        assert row["ttft_p90_ms"] >= row["ttft_p50_ms"]
    # Deterministic, not performance: every question after the first round finds its
    # document in a tier (all but the last block's tokens), never in the pool.
    assert result["off"]["hit_ratio"] == 0 and result["off"]["tier_hits"] == 0
    for s in ("host", "disk", "shared"):
        assert result[s]["hit_ratio"] > 0.8 and result[s]["tier_errors"] == 0, result[s]
    failed = result["shared_failed"]  # the store killed: every request still served
    assert failed["hit_ratio"] == 0 and failed["tier_errors"] > 0
    assert isinstance(result["tiers_ttft_p50_ratio"], float)
    assert result["tiers_hit_ratio"] == result["host"]["hit_ratio"]
