"""One recorded trace replayed in the simulated cluster under the real planner (sim_vs_real.py).

The trace is a list of requests (arrival time, prompt tokens, output tokens); the
cluster (planner/sim/cluster.py) runs on a profile's costs, with the start-up time observed
on the real side, and ``plan()`` runs every planner interval with the same
PlannerConfig that ``pdserve up --autoscale`` built from the same flags.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pdserve.planner.capacity import Profile
from pdserve.planner.config import PlannerConfig
from pdserve.planner.decision import PlannerState
from pdserve.planner.plan import plan
from pdserve.planner.sim.cluster import Cluster, CostModel
from pdserve.planner.sim.host import Host

# the tiny model's KV: 2 layers x 2 KV heads x 64 dims x float32 K and V; loopback tcp
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4
LOOPBACK_BYTES_PER_S = 1e9
LOOPBACK_LATENCY_S = 0.002


@dataclass(frozen=True)
class Trace:
    arrival: np.ndarray  # seconds from the start, sorted
    prompt: np.ndarray  # prompt tokens
    output: np.ndarray  # output tokens
    duration_s: float

    @classmethod
    def step(cls, low: float, high: float, phases: tuple[float, float, float], seed: int) -> Trace:
        """Poisson arrivals at ``low`` req/s, then ``high``, then ``low`` again, for the
        three ``phases`` (seconds); prompts ~256 tokens, outputs ~16 (lognormal)."""
        return cls.staircase((low, high, low), phases, seed)

    @classmethod
    def staircase(cls, rates: Sequence[float], phases: Sequence[float], seed: int) -> Trace:
        """Poisson arrivals at each of ``rates`` (req/s) for its ``phases`` (seconds);
        prompts ~256 tokens, outputs ~16 (lognormal)."""
        rng = np.random.default_rng(seed)
        times, t0 = [], 0.0
        for rate, length in zip(rates, phases, strict=True):
            n = rng.poisson(rate * length)
            times.append(t0 + np.sort(rng.random(n)) * length)
            t0 += length
        arrival = np.concatenate(times)
        n = arrival.size
        prompt = np.clip(np.round(rng.lognormal(math.log(256) - 0.18, 0.6, n)), 64, 1000)
        output = np.clip(np.round(rng.lognormal(math.log(16) - 0.18, 0.6, n)), 4, 48)
        return cls(arrival, prompt.astype(int), output.astype(int), t0)


@dataclass
class SimReplay:
    ttft: np.ndarray  # per finished request
    replica_s: float
    timeline: dict[str, list[float]]
    # each request with a first token: its arrival and TTFT, in the order of first tokens
    arrival: np.ndarray = field(default_factory=lambda: np.empty(0))
    ttft_by_arrival: np.ndarray = field(default_factory=lambda: np.empty(0))


def replay(
    trace: Trace,
    cfg: PlannerConfig,
    start: tuple[int, int],
    startup_s: float,
    interval_s: float,
    drain_s: float,
    dt: float = 0.05,
    host: Host | None = None,
    truth: Profile | None = None,
    max_starting: int = 0,
) -> SimReplay:
    """The trace through the simulated cluster; the truth is the planner's own profile
    (both from ``pdserve profile`` on this machine), on ``host``'s shared cores if given.

    The planner's ``startup_s`` is the pods' ``startup_s``: ``pdserve up``'s planner uses
    the start-up it timed on its own workers (local/autoscale.py, planner/startup.py), and
    every simulated pod, the first two included, takes ``startup_s``, so the same rule
    learns exactly that here. ``truth``: the cluster's costs where they are not the
    planner's profile (sim_vs_real_scaling.py: a prefill's CPU as the calibration
    measured it under its load). ``max_starting``: pods started at once, as the recorded
    ``--max-starting`` (0: no cap, as the recordings before it ran)."""
    cfg = replace(cfg, startup_s=startup_s)
    cost = CostModel(
        truth or cfg.profile,
        TINY_KV_BYTES_PER_TOKEN,
        LOOPBACK_BYTES_PER_S,
        LOOPBACK_LATENCY_S,
        startup_s,
        host,
        max_starting,
    )
    cluster = Cluster(cost, *start, cfg.slo.ttft_s, cfg.slo.tpot_s)
    state = PlannerState()
    every = max(1, round(interval_s / dt))
    tl: dict[str, list[float]] = {k: [] for k in ("t", "prefill", "decode")}
    ttfts: list[np.ndarray] = []
    replica_s, k = 0.0, 0
    for i in range(int((trace.duration_s + drain_s) / dt)):
        t = i * dt
        j = int(np.searchsorted(trace.arrival, t + dt, side="left"))
        if j > k:
            cluster.arrive(
                trace.arrival[k:j], trace.prompt[k:j].astype(float), trace.output[k:j].astype(float)
            )
            k = j
        cluster.tick(t, dt)
        n_p, n_d = cluster.prefill.started(), cluster.decode.started()  # processes, as real
        replica_s += (n_p + n_d) * dt
        tl["t"].append(t + dt)
        tl["prefill"].append(n_p)
        tl["decode"].append(n_d)
        if (i + 1) % every == 0:
            ttfts.extend(cluster.interval.ttft)  # the snapshot starts a new interval
            snap = cluster.snapshot(t + dt, every * dt)
            decision, state = plan(snap, state, cfg)
            cluster.prefill.scale(decision.prefill.desired, t + dt)
            cluster.decode.scale(decision.decode.desired, t + dt)
    ttfts.extend(cluster.interval.ttft)
    ttft = np.concatenate(ttfts) if ttfts else np.empty(0)
    both = [
        np.concatenate(x) if x else np.empty(0) for x in (cluster.first_arrival, cluster.first_ttft)
    ]
    return SimReplay(ttft, replica_s, tl, both[0], both[1])
