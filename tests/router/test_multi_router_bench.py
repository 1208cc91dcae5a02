"""``bench/multi_router.py --quick`` end to end: real workers, one router against three
replicas behind a round-robin client, and a replica started mid-run; one JSON line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.testing.loopback import run_bench, worker_port_base

pytestmark = pytest.mark.bench


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multi_router_bench_quick(tmp_path: Path) -> None:
    args = ("--quick", "--out", str(tmp_path), "--worker-port-base", str(worker_port_base()))
    r = run_bench("multi_router.py", *args, timeout=880)
    assert r["requests_per_kind"] == 32  # 4 groups x 8, each way
    # Three replicas route as well as one: they share the workers' view, not their own.
    assert r["prefix_hit_ratio_1"] >= 0.5  # only each group's first request may miss
    assert r["prefix_hit_ratio_3"] >= 0.95 * r["prefix_hit_ratio_1"]
    # The late replica, once ready, routes the cached groups like one that saw it all.
    assert r["late_requests"] >= 1 and r["late_hit_ratio"] >= 0.95 * r["late_control_hit_ratio"]
    assert len(r["loadavg"]) == 3
    assert (tmp_path / "multi_router-quick.png").stat().st_size > 0
