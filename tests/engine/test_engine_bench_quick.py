"""bench/engine.py --quick: ours vs transformers' continuous batching and static batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench


# The bench works and its output has its shape; how fast ours is against the baseline is
# bench/engine.py's to say (issue #45: performance bounds stay in bench, where the sides run
# alone). Before, this asserted ratio_cpu > 1.05 and ran serially with a retry, because a
# neighbour test moved the ratio (1.74 alone, 0.98 beside the rest of make test).
@pytest.mark.timeout(440)
def test_bench_quick(tmp_path: Path) -> None:
    plot = tmp_path / "engine.png"
    result = run_bench("engine.py", "--quick", "--threads", "1", "--plot", str(plot), timeout=200)
    for key in ("ours_tok_s", "baseline_tok_s", "ratio", "static_tok_s", "ratio_static"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    for key in ("overhead_share", "kv_waste", "attention_share", "matmul_rest_share"):
        assert isinstance(result[key], float) and 0 <= result[key] < 1, (key, result)
    assert result["attention_path"] == "kernel"  # the CPU kernel: no KV copies to count
    assert result["kv_copy_share"] == 0.0
    assert result["attention_share"] + result["matmul_rest_share"] + result["overhead_share"] == (
        pytest.approx(1.0, abs=1e-3)
    )
    assert result["quick"] is True and result["requests"] == 12
    assert result["baseline"].startswith("transformers continuous batching")
    assert result["threads"] == result["torch_threads"] == 1 and len(result["load_avg_start"]) == 3
    for key in ("ratio_cpu", "ratio_static_cpu"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["kv_waste"] < 0.5, result  # quick: 0.16; a block leak or over-allocation
    assert plot.stat().st_size > 1000
