"""Size the pools for the moment new pods become ready, not for now.

A pod ordered now serves from ``now + startup_s`` (T). Pods already starting are
credited from their expected ready time (their ETA), so a backlog is scaled for
once: the prefill queue is forecast to T as a fluid (arrivals from the forecast,
drained by the ready pods and by each starting pod from its ETA), and the pool is
sized for what T will hold::

    Q(t)' = demand(t) - serving(t) * mu          (Q >= 0; serving = ready + ETAs <= t)
    need  = demand(T) / (mu * rho*)  +  Q(T) / (mu * drain_s)

The steady need (what the scale-down window remembers) is this interval's
load without any queue; the floor a scale-down never goes under is the
forecast's peak over the next ``startup_s + interval`` seconds: "never below
what the forecast needs next".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.planner.config import PlannerConfig
from pdserve.planner.forecast import Forecast
from pdserve.planner.model import DecodeNeed, decode_need, prefill_rates
from pdserve.planner.snapshot import MetricsSnapshot, PoolStatus

STEP_S = 1.0  # resolution of the queue forecast


@dataclass(frozen=True)
class DecodeAhead:
    need: DecodeNeed  # at T
    steady_need: float
    floor: float


@dataclass(frozen=True)
class PrefillAhead:
    need: float
    steady_need: float
    floor: float  # forecast peak need over the next start-up + interval
    tokens_per_replica_s: float  # mu: one busy replica
    target_utilisation: float  # rho*
    demand_now: float  # prompt tokens/s (uncached), this interval
    demand_at_ready: float  # forecast at T
    queue_now: float  # prompt tokens waiting now
    queue_at_ready: float  # forecast at T
    mean_prompt: float


def etas_for(etas: tuple[float, ...], status: PoolStatus, now: float, startup_s: float) -> tuple:
    """Expected ready times of this pool's starting pods, reconciled with what is observed.

    Pods start in order, so the oldest ETAs belong to pods that are ready by now:
    keep the newest ``status.starting``; a starting pod the planner did not order
    (a manual edit, a restart) is assumed half-way through its start-up.
    """
    known = (
        sorted(e for e in etas if e > now - startup_s)[-status.starting :]
        if status.starting
        else []
    )
    missing = status.starting - len(known)
    out = [now + startup_s / 2] * missing + [max(e, now) for e in known]
    return tuple(sorted(out))


def prefill_ahead(
    snap: MetricsSnapshot,
    cfg: PlannerConfig,
    correction: float,
    fc: Forecast,
    etas: tuple,
    serving_now: int | None = None,
) -> PrefillAhead:
    """``serving_now``/``etas``: the replicas that prefill (the decode pool's when there
    is no prefill pool: decode workers prefill locally); default the prefill pool's."""
    mean_prompt, mu, rho = prefill_rates(snap, cfg, correction)
    uncached = 1.0 - snap.cached_token_fraction
    horizon = cfg.startup_s
    fcfg = cfg.forecast
    queue = 0.0
    if cfg.queue_aware:
        by_depth = snap.prefill_queue_depth * mean_prompt
        # Little's law over the served rate; not ready * mu: pods added since the wait
        # built up would inflate it
        served = min(snap.prompt_token_rate * uncached, snap.prefill.ready * mu)
        by_wait = snap.prefill_queue_wait_s * served
        queue = max(by_depth, by_wait)
    q = queue
    for i in range(math.ceil(horizon / STEP_S)):
        t = i * STEP_S
        ready = snap.prefill.ready if serving_now is None else serving_now
        serving = ready + sum(1 for e in etas if e <= snap.time_s + t)
        arrivals = fc.prompt_demand_at(t, fcfg) * uncached
        q = max(0.0, q + (arrivals - serving * mu) * STEP_S) if cfg.queue_aware else 0.0
    demand_t = fc.prompt_demand_at(horizon, fcfg) * uncached
    need = demand_t / (mu * rho) + q / (mu * cfg.queue_drain_s)
    peak = fc.prompt_peak(horizon + snap.interval_s, fcfg) * uncached
    steady = snap.prompt_token_rate * uncached / (mu * rho)
    return PrefillAhead(
        need,
        steady,
        peak / (mu * rho),
        mu,
        rho,
        snap.prompt_token_rate * uncached,
        demand_t,
        queue,
        q,
        mean_prompt,
    )


def decode_ahead(
    snap: MetricsSnapshot, cfg: PlannerConfig, correction: float, fc: Forecast, p: PrefillAhead
) -> DecodeAhead:
    """Decode at T: running sequences scale with the forecast rate (Little's law), output
    tokens are the forecast demand, and the prefill queue (now or at T, the larger)
    reaches decode as it drains."""
    level = fc.request_rate.level or 0.0
    fcfg, horizon = cfg.forecast, cfg.startup_s
    grow = fc.request_rate.at(horizon, fcfg) / level if level > 0 else 1.0
    peak_h = horizon + snap.interval_s
    peak = fc.request_rate.peak(peak_h, fcfg) / level if level > 0 else 1.0
    queued = max(p.queue_now, p.queue_at_ready) / p.mean_prompt
    d = decode_need(snap, cfg, correction, grow, queued, fc.output_demand_at(horizon, fcfg))
    # the window remembers demand, not a burst of generated tokens from a drained backlog
    demand_now = level * fc.output_per_request if fc.output_per_request else None
    now = decode_need(snap, cfg, correction, 1.0, 0.0, demand_now)
    out_peak = max(fc.output_demand_at(peak_h * i / 8, fcfg) for i in range(9))
    floor = decode_need(snap, cfg, correction, max(peak, 1.0), 0.0, out_peak).steady_need
    return DecodeAhead(d, now.steady_need, floor)
