"""bench/structured.py --quick: it runs and reports the wall-clock and CPU-time ratios of
schema-constrained vs free decoding (shape only: the figures are the bench's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(240)
def test_structured_bench_quick(tmp_path: Path) -> None:
    plot = tmp_path / "structured.png"
    result = run_bench("structured.py", "--quick", "--plot", str(plot), timeout=200)
    for key in ("free_wall_tok_s", "constrained_wall_tok_s", "free_tok_s", "constrained_tok_s"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["quick"] is True and result["requests"] == 8 and len(result["rounds"]) == 2
    assert result["threads"] == result["torch_threads"] == 1
    assert len(result["load_avg_start"]) == 3 and all("load_avg" in r for r in result["rounds"])
    lo, hi = result["ratio_range"]
    assert lo <= result["ratio"] <= hi
    # The same tokens decoded with and without a schema (the bench asserts it). No bound on
    # the ratios here (issue #45: performance bounds stay in bench/; 0.96x CPU in the quick
    # run at load ~17): every figure present and positive, and the grammar compiled once for
    # all the constrained requests of every round (by count, where a per-request compile
    # once showed as a wall-clock ratio near 0.1).
    for key in ("ratio_cpu", "ratio", "ratio_unqueued"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["grammars_compiled"] == 1, result
    assert result["compile_s"] > 0
    assert plot.stat().st_size > 1000
