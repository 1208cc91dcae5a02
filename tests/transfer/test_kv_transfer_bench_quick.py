"""bench/kv_transfer.py --quick runs end to end and prints its JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys

from kv_helpers import ROOT


def test_bench_quick(tmp_path) -> None:
    plot = tmp_path / "kv.png"
    out = subprocess.run(
        [sys.executable, "bench/kv_transfer.py", "--quick", "--threads", "1", "--plot", str(plot)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ["nixl_gbps", "tcp_gbps", "memcpy_gbps", "nixl_vs_memcpy", "nixl_vs_tcp"]:
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["quick"] is True and result["bytes"] > 0
    assert plot.stat().st_size > 1000
