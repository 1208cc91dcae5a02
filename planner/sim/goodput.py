"""Goodput of a P:D mix vs colocation, engine step by engine step (used by simulate.py).

DistServe's measure: the highest request rate at which >= 90% of requests meet both
the TTFT and the TPOT SLO (TPOT = a request's mean time per output token), per replica.
Unlike the fluid cluster (planner/sim/cluster.py), each replica here runs discrete engine steps,
so colocation's interference is what it is in the engine: a step that carries a prefill
chunk stretches the decode step of every sequence on that replica.

- prefill replica: token-budget steps (``chunk_tokens``) over its FIFO of prompts;
  ``chunk_overhead_s + n / tokens_per_s + q * (b^2 - a^2)`` for tokens a..b of a prompt.
- decode replica: ``step_time(B, mean context)``; admits sequences whose KV has arrived
  (``prompt * kv_bytes / link + latency`` after the first token), up to ``max_num_seqs``.
- colocated replica (no prefill pool; decode workers prefill locally): each step carries
  the decode batch and ``chunk_tokens`` minus one token per running sequence of prefill
  (the engine's scheduler: one token budget per step, running sequences first); its
  time is the decode step plus the chunk's token and attention cost (the step's fixed
  cost is paid once), so a long prompt's chunk stalls every running sequence on that
  replica for the chunk's time, as a real mixed step does.
A prompt goes to the front replica with the least queued work (the router's load
scorers; colocation keeps this, the better of the two rules for it). A prefilled
sequence goes to the decode replica the router's decode scorers rank first
(``router/config.py`` ``DECODE_SCORERS``): the free share of its KV pool plus
``1 / (1 + sequences / RUNNING_SCALE)``, among those with room for the sequence's KV
(``fits_kv``), counting sequences whose KV is still arriving (their blocks are taken).
Ranking by count alone left one replica with a few long contexts over the TPOT while
another ran short ones under it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.planner.capacity import Profile
from pdserve.router.config import DECODE_SCORERS
from pdserve.router.scheduling.scorers import RUNNING_SCALE

_DECODE_WEIGHTS = dict(DECODE_SCORERS)  # {"kv": w, "running": w}


@dataclass
class Req:
    arrival: float
    prompt: int
    out: int
    done: int = 0  # prompt tokens computed
    first: float = -1.0
    made: int = 0  # output tokens generated
    finish: float = -1.0


@dataclass
class Replica:
    kind: str  # "prefill" | "decode" | "colocated"
    pq: deque = field(default_factory=deque)  # prompts to prefill, FIFO
    waiting: list = field(default_factory=list)  # (kv ready time, req) for decode
    running: list = field(default_factory=list)
    busy: bool = False

    def load(self) -> float:
        return sum(r.prompt - r.done for r in self.pq) + 50.0 * (
            len(self.running) + len(self.waiting)
        )

    def decode_score(self, kv_capacity: int, prompt: int) -> tuple[bool, float]:
        """(room for ``prompt``'s KV, the router's decode score): best is largest."""
        seqs = len(self.running) + len(self.waiting)
        used = sum(r.prompt + r.made for r in self.running)
        used += sum(w[1].prompt for w in self.waiting)
        free = max(0.0, 1.0 - used / kv_capacity)
        score = _DECODE_WEIGHTS.get("kv", 0.0) * free
        score += _DECODE_WEIGHTS.get("running", 0.0) / (1.0 + seqs / RUNNING_SCALE)
        return kv_capacity - used >= prompt, score


@dataclass(frozen=True)
class Link:
    kv_bytes_per_token: int
    bytes_per_s: float
    latency_s: float


class StepSim:
    def __init__(self, prof: Profile, n_prefill: int, n_decode: int, link: Link) -> None:
        self.prof, self.link = prof, link
        kinds = ["prefill"] * n_prefill + ["decode" if n_prefill else "colocated"] * n_decode
        self.reps = [Replica(k) for k in kinds]
        self.events: list[tuple[float, int, int]] = []  # (time, seq, replica) step ends
        self.seq = 0

    def _kick(self, i: int, t: float) -> None:
        """Wake replica i at t (ignored if it is mid-step: its next step sees the work)."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, -1 - i))

    def arrive(self, req: Req, t: float) -> None:
        front = [i for i, r in enumerate(self.reps) if r.kind != "decode"]
        i = min(front, key=lambda j: self.reps[j].load())
        self.reps[i].pq.append(req)
        self._kick(i, t)

    def _to_decode(self, req: Req, t: float) -> None:
        back = [i for i, r in enumerate(self.reps) if r.kind == "decode"]
        cap = self.prof.decode.kv_capacity_tokens
        i = max(back, key=lambda j: self.reps[j].decode_score(cap, req.prompt))
        ready = t + req.prompt * self.link.kv_bytes_per_token / self.link.bytes_per_s
        self.reps[i].waiting.append((ready + self.link.latency_s, req))
        self._kick(i, ready + self.link.latency_s)

    def _step(self, i: int, t: float) -> float | None:
        """Plan and apply one step of replica i starting at t; its duration, None if idle."""
        rep, p, d = self.reps[i], self.prof.prefill, self.prof.decode
        if rep.kind != "prefill":
            ready = [w for w in rep.waiting if w[0] <= t]
            room = d.max_num_seqs - len(rep.running)
            for w in ready[: max(room, 0)]:
                rep.waiting.remove(w)
                rep.running.append(w[1])
        batch = rep.running if rep.kind != "prefill" else []
        dt = 0.0
        if batch:
            # sum/len, not np.mean: the same float (whole token counts sum exactly), and
            # np.mean of a short list was a fifth of bench/simulate.py --quick's time
            ctx = float(sum(r.prompt + r.made for r in batch)) / len(batch)
            dt += d.step_time(len(batch), ctx)
        # the engine's token budget (max_num_batched_tokens) covers the step's decode
        # tokens too: running sequences take one each first, prefill chunks what is left
        # (engine/scheduler.py: _schedule_running, then _admit_waiting with the rest)
        budget = p.chunk_tokens - len(batch) if rep.kind != "decode" else 0
        chunk: list[tuple[Req, int]] = []
        # a colocated engine's max_num_seqs counts the prompts it is prefilling too: one
        # beyond it waits (in TTFT) instead of joining the batch (engine/scheduler.py)
        room = d.max_num_seqs - len(batch) if rep.kind == "colocated" else len(rep.pq)
        for r in itertools.islice(rep.pq, max(room, 0)):
            if budget <= 0:
                break
            n = min(budget, r.prompt - r.done)
            chunk.append((r, n))
            budget -= n
        if chunk:
            dt += 0.0 if batch else p.chunk_overhead_s
            for r, n in chunk:
                a, b = r.done, r.done + n
                dt += n / p.tokens_per_s + p.attention_s_per_token_sq * (b * b - a * a)
        if dt == 0.0:
            return None
        end = t + dt
        for r in batch:
            r.made += 1
            if r.made >= r.out:
                r.finish = end
        rep.running = [r for r in rep.running if r.finish < 0]
        for r, n in chunk:
            r.done += n
            if r.done >= r.prompt:
                rep.pq.popleft()
                r.first, r.made = end, 1
                if r.out <= 1:
                    r.finish = end
                elif rep.kind == "colocated":
                    rep.running.append(r)
                else:
                    self._to_decode(r, end)
        return dt

    def run(self, reqs: list[Req], until: float) -> None:
        k = 0
        while True:
            next_arrival = reqs[k].arrival if k < len(reqs) else np.inf
            next_event = self.events[0][0] if self.events else np.inf
            if min(next_arrival, next_event) > until:
                return
            if next_arrival <= next_event:
                self.arrive(reqs[k], next_arrival)
                k += 1
                continue
            t, _, code = heapq.heappop(self.events)
            i = code if code >= 0 else -1 - code  # >= 0: a step ended; < 0: a wake-up
            if code < 0 and self.reps[i].busy:
                continue
            dt = self._step(i, t)
            self.reps[i].busy = dt is not None
            if dt is not None:
                self.seq += 1
                heapq.heappush(self.events, (t + dt, self.seq, i))


def attainment(
    prof: Profile,
    mix: tuple[int, int],
    rate: float,
    lengths: tuple[np.ndarray, np.ndarray],
    slo: tuple[float, float],
    link: Link,
    duration: float,
    seed: int = 0,
) -> float:
    """Share of requests (arriving after a warm-up) within both SLOs at ``rate`` req/s."""
    rng = np.random.default_rng(seed)
    n = rng.poisson(rate * duration)
    times = np.sort(rng.random(n) * duration)
    pick = rng.integers(0, lengths[0].size, n)
    reqs = [
        Req(float(t), int(lengths[0][j]), int(lengths[1][j]))
        for t, j in zip(times, pick, strict=True)
    ]
    sim = StepSim(prof, mix[0], mix[1], link)
    sim.run(reqs, duration * 1.5)
    counted = [r for r in reqs if r.arrival >= duration * 0.2]
    ok = 0
    for r in counted:
        if r.finish < 0 or r.first < 0:
            continue
        tpot = (r.finish - r.first) / (r.out - 1) if r.out > 1 else 0.0
        ok += (r.first - r.arrival) <= slo[0] and tpot <= slo[1]
    return ok / len(counted) if counted else 1.0


def goodput(
    prof: Profile,
    mix: tuple[int, int],
    lengths: tuple[np.ndarray, np.ndarray],
    slo: tuple[float, float],
    link: Link,
    duration: float,
    hi: float,
    iters: int = 8,
    seed: int = 0,
) -> float:
    """Highest rate (req/s, whole mix) with >= 90% of requests within both SLOs (bisection).

    Every rate is tried with the same ``seed`` (common random numbers), so attainment
    falls with the rate as it should rather than with the draw."""
    lo = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if attainment(prof, mix, mid, lengths, slo, link, duration, seed) >= 0.9:
            lo = mid
        else:
            hi = mid
    return lo
