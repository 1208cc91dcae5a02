"""A planner given a deliberately wrong profile adapts from observed metrics.

The simulated cluster (planner/sim/cluster.py) runs on the true H100 / Llama-3-8B costs;
the planner believes every cost is half what it is (a profile 2x too fast). Its online
corrections (observed vs predicted TTFT and TPOT) find the factor, and the pools settle
where a planner with the right profile puts them.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.planner.config import SLO, Bounds, PlannerConfig
from pdserve.planner.decision import PlannerState
from pdserve.planner.plan import plan
from pdserve.planner.presets import H100_LLAMA3_8B
from pdserve.planner.sim.cluster import Cluster, CostModel
from pdserve.planner.sim.scenarios import Mix, slower

pytestmark = pytest.mark.unit

TRUTH = CostModel(H100_LLAMA3_8B, 131_072, 40e9, 0.001, startup_s=20.0)


def run(planner_profile, minutes: float = 12.0, rate: float = 120.0):  # type: ignore[no-untyped-def]
    cfg = PlannerConfig(
        slo=SLO(2.0, 0.05),
        profile=planner_profile,
        prefill=Bounds(1, 100),
        decode=Bounds(1, 100),
        startup_s=TRUTH.startup_s,
        min_requests_for_correction=20,
    )
    rng, mix, dt = np.random.default_rng(3), Mix(), 0.5
    cluster, state = Cluster(TRUTH, 4, 4, 2.0, 0.05), PlannerState()
    counts = []
    for i in range(int(minutes * 60 / dt)):
        t = i * dt
        n = int(rng.poisson(rate * dt))
        prompt, output = mix.sample(rng, n, 0.0)
        cluster.arrive(np.sort(t + rng.random(n) * dt), prompt, output)
        cluster.tick(t, dt)
        if (i + 1) % 10 == 0:
            decision, state = plan(cluster.snapshot(t + dt, 5.0), state, cfg)
            cluster.prefill.scale(decision.prefill.desired, t + dt)
            cluster.decode.scale(decision.decode.desired, t + dt)
            counts.append((decision.prefill.desired, decision.decode.desired))
    late = np.concatenate(cluster.done_arrival) > minutes * 60 / 2
    ok = np.concatenate(cluster.done_ok)[late]
    return state, counts[-1], float(ok.mean())


@pytest.mark.timeout(120)
def test_a_profile_twice_too_fast_is_corrected_from_observed_latency() -> None:
    right_state, right_counts, _ = run(H100_LLAMA3_8B)
    state, counts, attainment = run(slower(H100_LLAMA3_8B, 0.5))  # believes 2x faster
    assert right_state.prefill_correction == pytest.approx(1.0, abs=0.3)
    assert state.prefill_correction == pytest.approx(2.0, rel=0.3)
    # the pools end where the right profile puts them (not at half of it); decode through
    # its correction or, where sequences wait for a slot, through the waiting term
    why = (state.decode_correction, counts, right_counts)
    assert counts[0] == pytest.approx(right_counts[0], rel=0.35), why
    assert counts[1] == pytest.approx(right_counts[1], rel=0.35), why
    assert attainment > 0.9, why
