"""bench/structured.py --quick: wall-clock and CPU-time ratios of schema-constrained vs free."""

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
    # The same tokens decoded with and without a schema (the bench asserts it). CPU time,
    # robust to other load: 0.96x in the quick run (2026-12-03, load average ~17). A mask
    # built in Python per token, or xgrammar's matcher rebuilt per step, is far below 0.6.
    assert result["ratio_cpu"] > 0.6, result
    # Wall clock moves with the host's load (quick: 0.89-1.00 per round at load ~17), so the
    # bound is looser; a grammar compiled per request (0.4-0.7 s each, 8 requests, against a
    # ~0.6 s pass) would put it near 0.1.
    assert result["ratio"] > 0.4, result
    # Wall time less the engine thread's run-queue waits: the path's own time. Both passes
    # decode alike, so a constrained pass that slept or spun (a lock, a thread hand-off)
    # would show here even when the host's load hides it in the wall-clock ratio.
    assert result["ratio_unqueued"] > 0.6, result
    assert result["compile_s"] > 0
    assert plot.stat().st_size > 1000
