"""bench/engine.py --quick runs end to end and prints its JSON line last."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loopback import run_bench


@pytest.mark.timeout(240)
def test_bench_quick(tmp_path: Path) -> None:
    plot = tmp_path / "engine.png"
    result = run_bench("engine.py", "--quick", "--threads", "1", "--plot", str(plot), timeout=200)
    for key in ("ours_tok_s", "baseline_tok_s", "ratio"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    for key in ("overhead_share", "kv_waste", "attention_share", "matmul_rest_share"):
        assert isinstance(result[key], float) and 0 <= result[key] < 1, (key, result)
    assert result["attention_path"] == "kernel"  # the CPU kernel: no KV copies to count
    assert result["kv_copy_share"] == 0.0
    assert result["attention_share"] + result["matmul_rest_share"] + result["overhead_share"] == (
        pytest.approx(1.0, abs=1e-3)
    )
    assert result["quick"] is True and result["requests"] == 12
    assert plot.stat().st_size > 1000
