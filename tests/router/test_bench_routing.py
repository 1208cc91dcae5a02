"""``bench/routing.py --quick`` end to end: real workers, two routers, one JSON line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.testing.loopback import ROOT, run_bench, worker_port_base

pytestmark = pytest.mark.bench

WORKERS = [ROOT / "prefill_worker" / "main.py", ROOT / "decode_worker" / "main.py"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not all(p.exists() for p in WORKERS), reason="real workers not built yet")
def test_routing_bench_quick(tmp_path: Path) -> None:
    args = ("--quick", "--out", str(tmp_path), "--worker-port-base", str(worker_port_base()))
    result = run_bench("routing.py", *args, timeout=880)
    for key in (
        "prefix_hit_ratio",
        "rr_hit_ratio",
        "prefix_ttft_p50_ms",
        "rr_ttft_p50_ms",
        "ttft_p50_speedup",
        "router_overhead_p50_ms",
        "proxy_overhead_p50_ms",
    ):
        assert isinstance(result[key], (int, float)), key
    assert result["prefix_requests"] == result["rr_requests"] == 16
    # 4 groups x 4 requests: only each group's first request may miss
    assert result["prefix_hit_ratio"] >= 0.6
    assert result["prefix_hit_ratio"] > result["rr_hit_ratio"]
    assert (tmp_path / "routing-quick.png").stat().st_size > 0
