"""bench/engine.py --quick runs end to end and prints its JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_bench_quick(tmp_path: Path) -> None:
    plot = tmp_path / "engine.png"
    out = subprocess.run(
        [sys.executable, "bench/engine.py", "--quick", "--threads", "1", "--plot", str(plot)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("ours_tok_s", "baseline_tok_s", "ratio"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    for key in ("overhead_share", "kv_waste"):
        assert isinstance(result[key], float) and 0 <= result[key] < 1, (key, result)
    assert result["quick"] is True and result["requests"] == 12
    assert plot.stat().st_size > 1000
