"""``bench/routing.py --quick`` end to end: real workers, two routers, one JSON line."""

from __future__ import annotations

import math
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
        assert isinstance(result[key], (int, float)) and math.isfinite(result[key]), key
    assert result["prefix_requests"] == result["rr_requests"] == 12  # 4 groups x 3 requests
    assert 0 <= result["rr_hit_ratio"] <= 1 and 0 <= result["prefix_hit_ratio"] <= 1
    # What the picker is for, not a speed: prefix-aware routing keeps groups on the worker
    # that caches them where round-robin thrashes both caches (only each group's first
    # request must miss: ~0.65 at best here; the full run's figures, docs/router.md)
    assert result["prefix_hit_ratio"] > result["rr_hit_ratio"]
    assert result["prefix_ttft_p50_ms"] > 0 and result["rr_ttft_p50_ms"] > 0
    assert (tmp_path / "routing-quick.png").stat().st_size > 0
