"""The simulated cluster's host model (bench/sim_host.py) and the colocated step's token
budget (bench/sim_goodput.py): pure functions and small simulations, no processes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from sim_goodput import Link, Replica, Req, StepSim
from sim_host import Host, fair_level, speed
from sim_replay import Trace, replay

from pdserve.planner.capacity import load_profile
from pdserve.planner.config import SLO, PlannerConfig

PROFILE = Path(__file__).resolve().parents[2] / "bench/profiles/cpu-tiny-1thread-cputime.json"


def test_fair_level_is_max_min_fairness() -> None:
    assert fair_level([(1, 0.5, 1.0), (1, 0.5, 1.0)], 2.0) == float("inf")  # all fit
    # 2 cores, 3 always-runnable threads and one that needs 0.2: it gets 0.2, they 0.6 each
    level = fair_level([(3, 1.0, 1.0), (1, 0.2, 1.0)], 2.0)
    assert level == pytest.approx(0.6, abs=1e-6)
    assert speed(0.2, level) == 1.0  # needs less than its share: runs whenever runnable
    assert speed(1.0, level) == pytest.approx(0.6)


def _host(background: float) -> Host:
    return Host(2.0, np.array([0.0]), np.array([background]), 0.02, 0.03, 0.3)


def test_the_host_model_slows_the_cluster_only_when_the_cores_are_short() -> None:
    cfg = PlannerConfig(slo=SLO(2.0, 0.5), profile=load_profile(PROFILE))
    trace = Trace.step(2.0, 12.0, (5.0, 10.0, 5.0), seed=0)
    own = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0)
    idle = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0, host=_host(0.0))
    busy = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0, host=_host(1.8))
    assert own.ttft.size == idle.ttft.size == trace.arrival.size
    # 2 free cores: each engine has its own; the path's measured latency is added
    assert np.median(idle.ttft) == pytest.approx(np.median(own.ttft) + 0.03, abs=0.01)
    # 0.2 free cores shared by two engines and the router: far slower (some requests still
    # wait for their first token when the replay ends)
    assert busy.ttft.size <= trace.arrival.size
    assert np.percentile(busy.ttft, 90) > 3 * np.percentile(idle.ttft, 90)


def test_a_colocated_step_gives_decode_tokens_their_share_of_the_budget() -> None:
    """engine/scheduler.py: running sequences take a token each first, a prefill chunk
    gets the rest of max_num_batched_tokens."""
    prof = load_profile(PROFILE)
    prof = replace(prof, prefill=replace(prof.prefill, chunk_tokens=64))
    sim = StepSim(prof, 0, 1, Link(1, 1e9, 0.0))
    rep: Replica = sim.reps[0]
    rep.running = [Req(0.0, 8, 100, done=8, first=0.0, made=1) for _ in range(10)]
    long = Req(0.0, 1000, 10)
    rep.pq.append(long)
    sim._step(0, 0.0)
    assert long.done == 64 - 10
