"""The simulated cluster's host model (planner/sim/host.py) and the colocated step's token
budget (planner/sim/goodput.py): pure functions and small simulations, no processes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pdserve.planner.capacity import load_profile
from pdserve.planner.config import SLO, PlannerConfig
from pdserve.planner.sim.goodput import Link, Replica, Req, StepSim
from pdserve.planner.sim.host import RHO_MAX, Host, cpu_slowdown, erlang_c, fair_level, speed
from pdserve.planner.sim.replay import Trace, replay

pytestmark = pytest.mark.unit

PROFILE = Path(__file__).resolve().parents[2] / "bench/profiles/cpu-tiny-1thread-cputime.json"


def test_fair_level_is_max_min_fairness() -> None:
    assert fair_level([(1, 0.5, 1.0), (1, 0.5, 1.0)], 2.0) == float("inf")  # all fit
    # 2 cores, 3 always-runnable threads and one that needs 0.2: it gets 0.2, they 0.6 each
    level = fair_level([(3, 1.0, 1.0), (1, 0.2, 1.0)], 2.0)
    assert level == pytest.approx(0.6, abs=1e-6)
    assert speed(0.2, level) == 1.0  # needs less than its share: runs whenever runnable
    assert speed(1.0, level) == pytest.approx(0.6)


def _bisection(groups: list, cores: float) -> float:
    """fair_level as it was written first: 50 plain bisection steps."""
    if sum(n * want for n, want, _ in groups) <= cores:
        return float("inf")
    lo, hi = 0.0, max(want / weight for _, want, weight in groups if weight > 0)
    for _ in range(50):
        mid = (lo + hi) / 2
        got = sum(n * min(want, mid * weight) for n, want, weight in groups)
        lo, hi = (mid, hi) if got < cores else (lo, mid)
    return lo


def test_fair_level_is_the_plain_bisection_bit_for_bit() -> None:
    """The steps decided from the water level give the same float as evaluating every
    step (replays are compared with recorded bounds and with each other exactly), for
    groups as Host.cpu builds them: engines, starting workers, our other processes and
    other sessions' CFS groups at their weights, saturated or not."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        k = int(rng.integers(1, 9))
        groups = [
            (
                float(rng.choice([0, 1, 1, 2, 3, 16])),
                float(rng.choice([1.0, rng.uniform(0, 1.5), 0.0])),
                float(rng.choice([1024.0, 1024 / 1.25**10, 15.0, rng.uniform(1, 2000)])),
            )
            for _ in range(k)
        ]
        cores = float(rng.choice([2.0, 0.1, rng.uniform(0.05, 4)]))
        assert fair_level(groups, cores) == _bisection(groups, cores), (groups, cores)


def _host(background: float) -> Host:
    return Host(2.0, np.array([0.0]), np.array([background]), 0.02, 0.03, 0.3)


def test_the_host_model_slows_the_cluster_only_when_the_cores_are_short() -> None:
    cfg = PlannerConfig(slo=SLO(2.0, 0.5), profile=load_profile(PROFILE))
    trace = Trace.step(2.0, 12.0, (5.0, 10.0, 5.0), seed=0)
    own = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0)
    flat = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0, host=replace(_host(0.0), queueing=False))
    idle = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0, host=_host(0.0))
    busy = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0, host=_host(1.8))
    assert own.ttft.size == idle.ttft.size == trace.arrival.size
    # 2 free cores: each engine has its own; the path's measured latency is added ...
    assert np.median(flat.ttft) == pytest.approx(np.median(own.ttft) + 0.03, abs=0.01)
    # ... and the bursts of 12 req/s on 2 cores stretch it some (queueing), not much
    assert np.median(flat.ttft) <= np.median(idle.ttft) < 1.5 * np.median(flat.ttft)
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


def test_a_prefilled_sequence_goes_where_the_router_would_send_it() -> None:
    """The step simulator's decode choice is the router's decode scorers (free KV share +
    running count, router/config.py DECODE_SCORERS), not the count alone: fewer but much
    longer contexts lose to more short ones, and a replica without room for the prompt's
    KV comes last (fits_kv)."""
    prof = load_profile(PROFILE)
    cap = 100_000
    prof = replace(prof, decode=replace(prof.decode, kv_capacity_tokens=cap))
    sim = StepSim(prof, 1, 2, Link(1, 1e9, 0.0))
    long, short = sim.reps[1], sim.reps[2]
    long.running = [Req(0.0, 40_000, 100, done=40_000, first=0.0, made=1) for _ in range(2)]
    short.running = [Req(0.0, 500, 100, done=500, first=0.0, made=1) for _ in range(3)]
    # count alone would pick the long replica (2 < 3); free KV 0.2 vs 0.985 decides it
    assert long.decode_score(cap, 1000)[1] < short.decode_score(cap, 1000)[1]
    req = Req(0.0, 1000, 10)
    sim._to_decode(req, 0.0)
    assert [w[1] for w in short.waiting] == [req] and not long.waiting
    # a sequence in flight holds its blocks: it counts as used at once
    assert short.decode_score(cap, 1000)[1] < Replica("decode").decode_score(cap, 1000)[1]
    # a 97k prompt fits only beside the short contexts (2.5k used, 80k on the other)
    assert short.decode_score(cap, 97_000)[0] is True
    assert long.decode_score(cap, 97_000)[0] is False


def test_erlang_c_and_the_slowdown_of_a_short_job() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert cpu_slowdown(0.5, 1.0) == pytest.approx(2.0)  # M/G/1-PS: 1 / (1 - rho)
    assert cpu_slowdown(0.5, 2.0) == pytest.approx(1 + (1 / 3) / (2 * 0.5))
    assert cpu_slowdown(0.0, 2.0) == 1.0
    # more cores at the same utilisation: less waiting; busier: more, up to the cap
    assert cpu_slowdown(0.6, 2.0) < cpu_slowdown(0.6, 1.0)
    levels = [cpu_slowdown(u, 2.0) for u in (0.2, 0.4, 0.6, RHO_MAX)]
    assert levels == sorted(levels)
    assert cpu_slowdown(3.0, 2.0) == cpu_slowdown(RHO_MAX, 2.0)


def test_utilisation_counts_bursts_not_cpu_bound_jobs() -> None:
    host = replace(
        _host(0.0),
        background_t=np.array([0.0]),
        background_groups=(((1.0, 0.3, 1024.0), (1.0, 1.0, 15.0)),),  # a 0.3 job, a hog
    )
    # engines' mean use 0.2 + 0.4, 10 req/s x 20 ms elsewhere, the bursty job's 0.3
    assert host.utilisation(0.0, [0.2, 0.4], 1, 10.0) == pytest.approx((0.6 + 0.2 + 0.3) / 2)


def test_queueing_stretches_ttft_on_busy_cores_only() -> None:
    """A prefill and the path wait for a core on busy cores (planner/sim/host.py: queueing); with
    the cores to itself the replay is what it was without the term."""
    cfg = PlannerConfig(slo=SLO(2.0, 0.5), profile=load_profile(PROFILE))
    trace = Trace.step(2.0, 12.0, (5.0, 10.0, 5.0), seed=0)
    runs = {}
    for name, host in (("quiet", _host(0.0)), ("busy", _host(0.9))):
        for q in (False, True):
            h = replace(host, queueing=q, other_s_per_request=0.0)
            if name == "busy":  # the other jobs in bursts: they count in the utilisation
                h = replace(h, background_groups=(((1.0, 0.9, 1024.0),),))
            runs[name, q] = replay(trace, cfg, (1, 1), 30.0, 2.0, 5.0, host=h).ttft
    quiet = np.median(runs["quiet", True]) / np.median(runs["quiet", False])
    busy = np.median(runs["busy", True]) / np.median(runs["busy", False])
    assert 1.0 <= quiet < 1.25  # the engines' own bursts on 2 cores: a little
    assert busy > quiet + 0.1  # 0.9 of a core busy beside them: clearly more


def test_the_idle_path_is_fit_as_fixed_plus_per_prompt_token() -> None:
    """The idle probe's latency beside the prefill (sim_vs_real_host._path_fit): 7 ms
    plus 10 us per prompt token is recovered from noisy probes of three lengths; a
    probe that does not grow with the prompt is one constant (its median)."""
    from sim_vs_real_host import _path_fit

    lengths = [64, 256, 512] * 3
    noise = [0.4e-3, -0.3e-3, 0.2e-3, -0.2e-3, 0.3e-3, -0.4e-3, 0.0, 0.1e-3, 0.0]
    path = [7e-3 + 10e-6 * n + e for n, e in zip(lengths, noise, strict=True)]
    fixed, per_token = _path_fit(path, lengths)
    assert fixed == pytest.approx(7e-3, abs=0.5e-3)
    assert per_token == pytest.approx(10e-6, rel=0.15)
    flat = [9e-3 - 1e-6 * n for n in lengths]  # falls with the prompt: not a per-token cost
    assert _path_fit(flat, lengths) == (pytest.approx(float(np.median(flat))), 0.0)
    assert _path_fit([8e-3, 9e-3], [256, 256]) == (pytest.approx(8.5e-3), 0.0)


def test_the_path_fit_on_medians_holds_against_one_slow_probe() -> None:
    """Since 2026-12-04 the probe runs 7 requests per length and the path is fit on each
    length's median: one 512-token probe of 21 that is 25 ms slow (the 16:46 calibration
    had two of 9) tilts the least-squares slope from 10 to ~18 us per token; the medians'
    fit keeps it within 15%. A fit that ignored ``medians`` fails."""
    from sim_vs_real_host import _path_fit

    lengths = [64, 256, 512] * 7
    path = [7e-3 + 10e-6 * n for n in lengths]
    path[-1] += 25e-3
    fixed, per_token = _path_fit(path, lengths, medians=True)
    assert per_token == pytest.approx(10e-6, rel=0.15)
    assert fixed == pytest.approx(7e-3, abs=0.5e-3)
    _, tilted = _path_fit(path, lengths)
    assert tilted > 15e-6  # the old fit, kept for the recordings before
