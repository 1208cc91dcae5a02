"""Discrete-time model of a P/D cluster, vectorised with numpy (used by simulate.py).

Each tick (``dt`` seconds) new requests arrive; the prefill pool serves them FIFO
as a fluid of *work* (busy seconds of one replica: chunk overheads amortised,
linear and quadratic attention cost), so a request starts when the pool has done
all work queued ahead of it and completes one unshared prefill later; its KV
moves to decode in ``bytes / link bandwidth + latency``; the decode pool admits
it when a sequence slot and KV room are free; every decode step advances each
running sequence by one token and takes ``step_time(batch, context)`` with the
batch spread evenly over ready replicas. Pods become ready ``startup_s`` after
they are added; scale-down removes starting pods first. With ``max_starting`` (as
``pdserve up --max-starting``) a pod past the cap is pending: counted in its pool,
started when a starting one is ready (the pool furthest short first), removed first.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.planner.capacity import Profile
from pdserve.planner.sim.host import Host, cpu_slowdown, speed
from pdserve.planner.snapshot import LatencyStats, MetricsSnapshot, PoolStatus


@dataclass(frozen=True)
class CostModel:
    truth: Profile  # the cluster's real costs (the planner gets its own, possibly wrong, profile)
    kv_bytes_per_token: int
    link_bytes_per_s: float
    link_latency_s: float
    startup_s: float  # pod added -> ready (scheduling, weights load, warm-up)
    host: Host | None = None  # replicas sharing one machine's cores (a local replay); None: own
    max_starting: int = 0  # pods starting at once, both pools (local/autoscale.py); 0: no cap


class Pool:
    """Pods of one role: ready times of every pod that holds an accelerator (``inf``: a
    pending pod, not started)."""

    def __init__(self, n: int, startup_s: float, capped: bool = False) -> None:
        self.ready_at: list[float] = [-1.0] * n  # sorted: pods are added in time order
        self.startup_s = startup_s
        self.capped = capped  # pods wait pending for Cluster.start_pending

    def ready(self, t: float) -> int:
        return bisect.bisect_right(self.ready_at, t)

    def started(self) -> int:
        return bisect.bisect_left(self.ready_at, math.inf)

    def status(self, t: float) -> PoolStatus:
        return PoolStatus(len(self.ready_at), self.ready(t), 0)

    def scale(self, n: int, t: float) -> None:
        if n > len(self.ready_at):
            at = math.inf if self.capped else t + self.startup_s
            self.ready_at += [at] * (n - len(self.ready_at))
        else:
            del self.ready_at[n:]  # pending, then latest-ready (unready) last, removed first

    def start_one(self, t: float) -> None:
        self.ready_at[self.started()] = t + self.startup_s


@dataclass
class Interval:
    """What the cluster saw since the planner last looked."""

    arrived: int = 0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft: list[np.ndarray] = field(default_factory=list)
    wait: list[np.ndarray] = field(default_factory=list)
    tpot: list[np.ndarray] = field(default_factory=list)


def _stats(parts: list[np.ndarray], target: float) -> LatencyStats:
    if not parts:
        return LatencyStats()
    x = np.concatenate(parts)
    if x.size == 0:
        return LatencyStats()
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return LatencyStats(
        int(x.size),
        float(x.mean()),
        float(p50),
        float(p90),
        float(p99),
        float((x <= target).mean()),
    )


RUN = ("target", "join", "prompt", "first", "arrival", "ok")
# the host model's view of what the cores hold now (arrivals, prefill work, decode use) is
# smoothed over about this long: a request's residence (a prefill plus the path, 20-50 ms,
# then ~16 decode steps of 3-5 ms). Over 1 s, as before 2026-12-02, a request arriving
# right behind others saw the second's average and not the burst it met: the recordings
# of quiet runs had those requests at real p50 40 ms vs simulated 24 (arrival gap < 20 ms)
# while those arriving 0.1 s+ after the previous agreed (19.0 vs 19.0 ms).
BURST_WINDOW_S = 0.1
TARGET, JOIN, PROMPT, FIRST, ARRIVAL, OK = range(len(RUN))


class Cluster:
    def __init__(self, cost: CostModel, n_prefill: int, n_decode: int, ttft: float, tpot: float):
        self.cost, self.ttft_slo, self.tpot_slo = cost, ttft, tpot
        capped = cost.max_starting > 0
        self.prefill = Pool(n_prefill, cost.startup_s, capped)
        self.decode = Pool(n_decode, cost.startup_s, capped)
        self.work_arrived = 0.0  # cumulative prefill work (replica-seconds) that arrived
        self.work_done = 0.0
        self.pq: deque[dict[str, np.ndarray]] = deque()  # waiting for prefill, FIFO blocks
        self.dq: deque[dict[str, np.ndarray]] = deque()  # waiting for a decode slot
        self.run = np.empty((len(RUN), 0))  # rows: RUN fields, one column per running sequence
        self.G = 0.0  # decode steps taken so far (every running sequence advances with it)
        self.ctx_sum = 0.0  # sum over running of (prompt - join); + n * G = total context
        self.interval = Interval()
        self.admitted_at = -1.0  # time of the last decode admission
        self.done_arrival: list[np.ndarray] = []  # per finished request: arrival time ...
        self.done_ok: list[np.ndarray] = []  # ... and whether it met both SLOs
        self.first_arrival: list[np.ndarray] = []  # per first token, in time order: arrival
        self.first_ttft: list[np.ndarray] = []  # ... and TTFT (the scale windows' errors)
        self.speed_p = self.speed_d = 1.0  # this tick's engine speeds (host model)
        self.slow_burst = 1.0  # how much longer a prefill and the path take (host model)
        self.work_rate = 0.0  # prefill work arriving, replica-s per second (BURST_WINDOW_S)
        self.work_seen = 0.0
        self.decode_use = 0.0  # CPU of one busy decode engine, cores (host model)
        self.rate = 0.0  # arrivals per second, smoothed (BURST_WINDOW_S, host model)
        self.arrived_tick = 0

    # -- arrivals and prefill ----------------------------------------------------------------
    def arrive(self, t: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> None:
        p = self.cost.truth.prefill
        work = (p.chunk_overhead_s / p.chunk_tokens + 1 / p.tokens_per_s) * prompt
        work += p.attention_s_per_token_sq * prompt**2
        end = self.work_arrived + np.cumsum(work)
        self.work_arrived = float(end[-1]) if end.size else self.work_arrived
        service = p.chunk_overhead_s * np.maximum(1, np.ceil(prompt / p.chunk_tokens))
        service = service + prompt / p.tokens_per_s + p.attention_s_per_token_sq * prompt**2
        self.pq.append(
            {"t": t, "start": end - work, "prompt": prompt, "out": output, "service": service}
        )
        self.interval.arrived += t.size
        self.arrived_tick += t.size
        self.interval.prompt_tokens += float(prompt.sum())

    def _prefill_tick(self, t0: float, dt: float) -> None:
        ready = self.prefill.ready(t0)
        before = self.work_done
        self.work_done = min(self.work_arrived, before + ready * dt * self.speed_p)
        rate = (self.work_done - before) / dt
        while self.pq:
            blk = self.pq[0]
            n = int(np.searchsorted(blk["start"], self.work_done, side="right"))
            if n == 0:
                break
            started = {k: v[:n] for k, v in blk.items()}
            if n == blk["t"].size:
                self.pq.popleft()
            else:
                self.pq[0] = {k: v[n:] for k, v in blk.items()}
            when = t0 + (started["start"] - before) / rate if rate > 0 else np.full(n, t0)
            when = np.maximum(when, started["t"])
            first = when + started["service"] * max(1.0 / self.speed_p, self.slow_burst)
            if self.cost.host is not None:  # the serving path beside the engine
                h = self.cost.host
                path = h.path_s + h.path_s_per_token * started["prompt"]
                first = first + path * self.slow_burst / h.path_slow
            self.interval.wait.append(when - started["t"])
            self.interval.ttft.append(first - started["t"])
            self.first_arrival.append(started["t"])
            self.first_ttft.append(first - started["t"])
            transfer = started["prompt"] * self.cost.kv_bytes_per_token / self.cost.link_bytes_per_s
            self.dq.append(
                {**started, "first": first, "ready": first + transfer + self.cost.link_latency_s}
            )

    # -- decode --------------------------------------------------------------------------------
    def _admit(self, t: float, ready: int) -> None:
        d = self.cost.truth.decode
        seats = ready * d.max_num_seqs - self.run.shape[1]
        kv_free = 0.95 * ready * d.kv_capacity_tokens - self._context_total()
        joined = []
        while self.dq and seats > 0 and kv_free > 0:
            blk = self.dq[0]
            ok = blk["ready"] <= t  # admit the leading run of ready requests (FIFO)
            eligible = ok.size if ok.all() else int(np.argmin(ok))
            fits = int(np.searchsorted(np.cumsum(blk["prompt"][:eligible]), kv_free, "right"))
            n = min(eligible, seats, fits)
            if n == 0:
                break
            joined.append({k: v[:n] for k, v in blk.items()})
            seats -= n
            kv_free -= float(blk["prompt"][:n].sum())
            if n == blk["t"].size:
                self.dq.popleft()
            else:
                self.dq[0] = {k: v[n:] for k, v in blk.items()}
                break
        if joined:
            self._join({k: np.concatenate([b[k] for b in joined]) for k in joined[0]})

    def _join(self, b: dict[str, np.ndarray]) -> None:
        new = np.empty((len(RUN), b["t"].size))
        new[TARGET] = self.G + np.maximum(b["out"] - 1, 0)
        new[JOIN] = self.G
        new[PROMPT] = b["prompt"]
        new[FIRST] = b["first"]
        new[ARRIVAL] = b["t"]
        new[OK] = (b["first"] - b["t"]) <= self.ttft_slo
        self.run = np.concatenate([self.run, new], axis=1)
        self.ctx_sum += float((b["prompt"] - self.G).sum())

    def _context_total(self) -> float:
        return self.ctx_sum + self.run.shape[1] * self.G

    def _decode_tick(self, t0: float, dt: float) -> None:
        ready = self.decode.ready(t0)
        self._admit(t0, ready)
        self.admitted_at = t0
        n = self.run.shape[1]
        if n == 0 or ready == 0:
            self.decode_use -= self.decode_use * min(1.0, dt / BURST_WINDOW_S)
            return
        step = self.cost.truth.decode.step_time(n / ready, self._context_total() / n) / self.speed_d
        steps = dt / step
        g0, self.G = self.G, self.G + steps
        self.interval.output_tokens += steps * n
        done = self.run[TARGET] <= self.G
        # the CPU a decode engine used this tick: busy until its last sequence finished
        busy = 1.0 if not done.all() else float((self.run[TARGET].max() - g0) / steps)
        use = min(1.0, busy) * self.speed_d
        self.decode_use += (use - self.decode_use) * min(1.0, dt / BURST_WINDOW_S)
        if not done.any():
            return
        fin = self.run[:, done]
        self.run = self.run[:, ~done]
        self.ctx_sum -= float((fin[PROMPT] - fin[JOIN]).sum())
        t_end = t0 + np.clip((fin[TARGET] - g0) / steps, 0, 1) * dt
        out = fin[TARGET] - fin[JOIN] + 1
        tpot = np.where(out > 1, (t_end - fin[FIRST]) / np.maximum(out - 1, 1), 0.0)
        self.interval.tpot.append(tpot[out > 1])
        self.done_arrival.append(fin[ARRIVAL])
        self.done_ok.append(((fin[OK] > 0) & (tpot <= self.tpot_slo)).astype(np.int8))

    def start_pending(self, t: float) -> None:
        """Start pending pods while fewer than ``max_starting`` are starting (the pool with
        the most pending first, prefill on a tie), as local/autoscale.py's LocalPools."""
        if not self.cost.max_starting:
            return
        pools = (self.prefill, self.decode)
        while True:
            pool = max(pools, key=lambda p: len(p.ready_at) - p.started())
            starting = sum(p.started() - p.ready(t) for p in pools)
            if pool.started() == len(pool.ready_at) or starting >= self.cost.max_starting:
                return
            pool.start_one(t)

    def tick(self, t0: float, dt: float) -> None:
        self.start_pending(t0)
        if self.cost.host is not None:
            self._share_host(t0, dt)
        self._prefill_tick(t0, dt)
        self._decode_tick(t0, dt)

    def _share_host(self, t0: float, dt: float) -> None:
        """This tick's engine speeds on the shared host (planner/sim/host.py)."""
        host = self.cost.host
        assert host is not None
        self.rate += (self.arrived_tick / dt - self.rate) * min(1.0, dt / BURST_WINDOW_S)
        new_work = (self.work_arrived - self.work_seen) / dt
        self.work_rate += (new_work - self.work_rate) * min(1.0, dt / BURST_WINDOW_S)
        self.arrived_tick, self.work_seen = 0, self.work_arrived
        n_p, n_d = self.prefill.ready(t0), self.decode.ready(t0)
        backlog = (self.work_arrived - self.work_done) / dt  # replica-seconds per second
        want_p = min(1.0, backlog / n_p) if n_p else 0.0
        busy_d = min(n_d, self.run.shape[1])  # a decode engine with sequences loops
        engines = [want_p] * (n_p if want_p > 0 else 0) + [1.0] * busy_d
        starting = self.prefill.started() + self.decode.started() - n_p - n_d
        cpu = host.cpu(t0, engines, starting, self.rate)
        self.speed_p, self.speed_d = speed(want_p, cpu), speed(1.0, cpu)
        if host.queueing and n_p:
            # a prefill runs in bursts: while it runs it wants a core, so on saturated cores
            # it gets an always-runnable thread's share; on busy ones it sometimes waits.
            # The decode engines compete with what they use (the fluid decode finishes a
            # short request's tokens inside one tick, so "has sequences now" misses them)
            use_d = [self.decode_use] * n_d
            share = speed(1.0, host.cpu(t0, [1.0] * n_p + use_d, starting, self.rate))
            use_p = [min(1.0, self.work_rate / n_p)] * n_p
            rho = host.utilisation(t0, use_p + use_d, starting, self.rate)
            self.slow_burst = max(1.0 / share, cpu_slowdown(rho, host.cores))
        else:
            self.slow_burst = 1.0

    # -- what the planner sees --------------------------------------------------------------------
    def snapshot(self, t: float, interval_s: float) -> MetricsSnapshot:
        iv, self.interval = self.interval, Interval()
        waiting_prefill = sum(b["t"].size for b in self.pq)
        # waiting for a decode slot: KV transferred by the last admission and still not
        # admitted (one that arrived since waits only for the next tick, as an engine's
        # next step would take it: not a full pool)
        waiting_decode = sum(int((b["ready"] <= self.admitted_at).sum()) for b in self.dq)
        ready_d = self.decode.ready(t)
        kv_total = ready_d * self.cost.truth.decode.kv_capacity_tokens
        wait = np.concatenate(iv.wait) if iv.wait else np.empty(0)
        return MetricsSnapshot(
            time_s=t,
            interval_s=interval_s,
            prefill=self.prefill.status(t),
            decode=self.decode.status(t),
            ttft=_stats(iv.ttft, self.ttft_slo),
            tpot=_stats(iv.tpot, self.tpot_slo),
            request_rate=iv.arrived / interval_s,
            prompt_token_rate=iv.prompt_tokens / interval_s,
            output_token_rate=iv.output_tokens / interval_s,
            prefill_queue_depth=float(waiting_prefill),
            prefill_queue_wait_s=float(wait.mean()) if wait.size else 0.0,
            decode_running=float(self.run.shape[1]),
            decode_waiting=float(waiting_decode),
            kv_utilisation=min(1.0, self._context_total() / kv_total) if kv_total else 0.0,
        )

    def unfinished_arrivals(self) -> np.ndarray:
        parts = [b["t"] for b in self.pq] + [b["t"] for b in self.dq] + [self.run[ARRIVAL]]
        return np.concatenate(parts) if parts else np.empty(0)
