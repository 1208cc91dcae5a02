"""``bench/routing.py --quick`` end to end: real workers, two routers, one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKERS = [ROOT / "prefill_worker" / "main.py", ROOT / "decode_worker" / "main.py"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not all(p.exists() for p in WORKERS), reason="real workers not built yet")
def test_routing_bench_quick(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "routing.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=880, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("prefix_hit_ratio", "rr_hit_ratio", "prefix_ttft_p50_ms", "rr_ttft_p50_ms",
                "ttft_p50_speedup", "router_overhead_p50_ms", "proxy_overhead_p50_ms"):  # fmt: skip
        assert isinstance(result[key], (int, float)), key
    assert result["prefix_requests"] == result["rr_requests"] == 16
    # 4 groups x 4 requests: only each group's first request may miss
    assert result["prefix_hit_ratio"] >= 0.6
    assert result["prefix_hit_ratio"] > result["rr_hit_ratio"]
    assert (tmp_path / "routing-quick.png").stat().st_size > 0
