"""The simulated cluster mirrors ``pdserve up --max-starting`` (planner/sim/cluster.py).

A pod past the cap is pending: counted in its pool's status (the planner ordered it),
not a process (no replica-seconds, no start-up CPU on the host model), started when a
starting pod is ready, the pool with the most pending first, and removed first on a
scale-down: the rules of local/autoscale.py's LocalPools (tests/local/test_max_starting.py).
Without a cap every ordered pod starts at once, as the recordings before the flag ran.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.planner.presets import CPU_TINY
from pdserve.planner.sim.cluster import Cluster, CostModel

pytestmark = pytest.mark.unit

COST = CostModel(CPU_TINY, 2048, 1e9, 0.002, startup_s=4.0)


def _started(cluster: Cluster) -> tuple[int, int]:
    return cluster.prefill.started(), cluster.decode.started()


def test_one_start_up_at_a_time_then_the_next() -> None:
    cluster = Cluster(replace(COST, max_starting=1), 1, 1, 0.2, 0.5)
    cluster.prefill.scale(3, 10.0)
    cluster.decode.scale(2, 10.0)
    cluster.tick(10.0, 0.05)
    assert _started(cluster) == (2, 1)  # uncapped it would be (3, 2)
    assert cluster.prefill.status(10.0).current == 3  # the planner sees what it ordered
    cluster.tick(13.9, 0.05)
    assert _started(cluster) == (2, 1)  # prefill-1 ready at 14.0
    cluster.tick(14.0, 0.05)
    assert _started(cluster) == (3, 1)  # a tie of one pending each: prefill first
    cluster.tick(18.0, 0.05)
    assert _started(cluster) == (3, 2)
    assert cluster.decode.ready_at[-1] == 22.0


def test_a_scale_down_drops_pending_pods_first() -> None:
    cluster = Cluster(replace(COST, max_starting=1), 1, 1, 0.2, 0.5)
    cluster.prefill.scale(3, 10.0)
    cluster.tick(10.0, 0.05)
    cluster.prefill.scale(2, 11.0)
    assert cluster.prefill.ready_at == [-1.0, 14.0]  # the starting one stays


def test_no_cap_starts_every_ordered_pod() -> None:
    cluster = Cluster(COST, 1, 1, 0.2, 0.5)
    cluster.prefill.scale(3, 10.0)
    cluster.decode.scale(2, 10.0)
    cluster.tick(10.0, 0.05)
    assert _started(cluster) == (3, 2)
