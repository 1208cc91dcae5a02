"""``bench/operator_load.py --quick``: the watch-driven operator and routers are idle when the
fleet is."""

from __future__ import annotations

import pytest

from tests.loopback import run_bench

pytestmark = pytest.mark.timeout(180)


def test_operator_load_quick() -> None:
    result = run_bench("operator_load.py", "--quick", timeout=170)
    assert result["llmservices"] == 5
    # Steady state: no polling, so (almost) no requests; the goal is <= 2 per object-minute.
    assert result["api_requests_per_object_minute"] <= 2.0
    assert result["goal_met"] is True
    assert 0 < result["apply_to_children_p50_s"] <= result["apply_to_children_p99_s"] < 60
    # The routers' discovery, side by side: the watch costs nothing at steady state, the
    # pod LIST it replaced one request per second per router.
    assert result["routers"] == 2
    assert result["router_requests_per_replica_minute"] == 0.0
    assert result["baseline_router_requests_per_replica_minute"] > 20
