"""The machine a local replay runs on, as the simulated cluster shares it (sim_vs_real.py).

On a GPU cluster each replica has its own accelerator, and the profile's per-replica
costs are the whole story. ``pdserve up`` on this machine runs every worker, the
router, ``pdserve up`` itself and the load client on the same few cores, next to other
people's jobs, so a worker's engine runs only as fast as its share of a core. The host
model gives the simulated cluster that share, from measurement only
(sim_vs_real_host.py builds it from /proc, sim_vs_real_cpu.py):

- ``cores``: ``len(os.sched_getaffinity(0))``;
- ``background``: the cores other jobs used, per 0.5 s of the replay (/proc/stat busy
  time minus our processes'): they run at nice 0 or 10 like ours, so what they took
  they would have taken from the simulated workers too;
- ``other_s_per_request``: CPU seconds per request of everything but the engine
  threads (router, ``pdserve up``, the client, the workers' HTTP, streaming and KV
  transfer threads);
- ``startup_cores``: what a starting worker uses (model load, warm-up): its CPU until
  ready over its start-up time;
- ``path_s`` + ``path_s_per_token`` x prompt: the serving path's latency beside the
  engine's prefill (HTTP hops client -> router -> prefill worker -> router -> client;
  the prompt's ids as JSON and its KV hand-off grow with it), fit to single requests of
  three lengths on the idle service just before the trace: TTFT minus the profile's
  ``prefill_time`` (the first probe, a warm-up, left out).

Under autogroup scheduling (``kernel.sched_autogroup_enabled``, on here) CFS is two
levels deep: every session is one group, weighted by its autogroup's nice
(``/proc/PID/autogroup``), and a process's own nice only ranks it inside its session.
So another job competes with our workers as its whole session (its processes' wants
summed, at its autogroup's weight: ``autogroup_entities``), and our workers (each in its
own session: ``pdserve up`` starts them so) at their autogroups' weight; a process of the
root group (kernel threads) competes by itself at its own nice.

Each tick, the cores the background left are shared by our runnable threads (Linux's
CFS, equal nice levels: max-min fair shares, ``fair_level``); a thread that needs less
than the fair share gets what it needs on average, while an engine that needs more (a
decode loop with sequences, a backlogged prefill) runs at the fair share: its steps take
1/share longer. The engine's costs come from a profile of the engine thread's CPU time
(``pdserve profile --clock cpu``), so waiting for a core is counted once, here, and not
also in the profile.

Latency is not the average, though (``queueing``, on by default). A prefill and the
serving path's hops run in bursts: while one runs it wants a core, so on saturated cores
it gets an always-runnable thread's share (``cpu`` with it runnable), and on busy but
not saturated cores it sometimes finds every core taken and waits (``cpu_slowdown``:
M/M/c under processor sharing on the bursty part of the load, ``utilisation``, capped at
``RHO_MAX``). A request's prefill time and path latency are stretched by the larger of
the two. Without it, a replay on a quiet machine at 12 req/s had the simulated p90 TTFT
at 40% of the real one (bench/recordings/sim_vs_real/2026-12-01-1011-full-autogroup).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Group = tuple[float, float, float]  # (threads, the share of a core each wants, weight)
HOG = 0.5  # another job's process that used this much of a core was always runnable
# the utilisation the queueing term is capped at: beyond it M/M/c's 1/(1 - rho) blows up,
# where CFS lets a thread waking from sleep run ahead of the CPU-bound ones; the fair
# shares (a bursting thread's share) account for the rest. Chosen on the recordings in
# bench/recordings/sim_vs_real: their p90 errors barely move between 0.8, 0.9 and 0.95, their p50
# errors are lowest at 0.8 (docs/autoscaling.md, "Waiting for a core")
RHO_MAX = 0.8


def nice_weight(nice: int) -> float:
    """CFS's load weight of a nice level (1024 at 0, x1.25 per level: 15 at 19)."""
    return 1024.0 / 1.25**nice


def job_groups(cores_used: float, nice: int, our_nice: int, hog: bool = False) -> list[Group]:
    """Another job's process as CFS sees it, from what it used over a window beside our
    processes at ``our_nice``: ``cores_used`` of CPU ran on that many threads. One of
    higher priority than ours took what it wanted (we could not squeeze it): it wants
    what it took. One of equal or lower priority that is a ``hog`` (runnable all the
    time: see ``is_hog``) took what the others left it: it wants a whole core per
    thread, and takes its fair share from the simulated workers as from the real ones."""
    threads = max(1, math.ceil(cores_used - 0.2))
    each = cores_used / threads
    squeezed = nice >= our_nice and (hog or each >= HOG)
    return [(float(threads), 1.0 if squeezed else each, nice_weight(nice))]


def is_hog(used_per_window: list[float], windows: int) -> bool:
    """A process that ran in nearly every one of the ``windows`` sampling periods and
    used on average at least half of ``HOG`` per period it ran in is CPU-bound (a
    benchmark, a simulation): where it used less, it was squeezed, not idle."""
    ran = len(used_per_window)
    return ran >= 0.8 * windows and sum(used_per_window) / max(ran, 1) >= HOG / 2


def autogroup_entities(
    procs: list[tuple[int, float, int, int, int, bool]], our_nice: int
) -> list[Group]:
    """Other jobs in one window as CFS's top level sees them under autogroup: one entity
    per session (``(1, what its processes want summed, its autogroup's weight)``), and
    one per process of the root group (autogroup id 0, by its own nice). ``procs``:
    ``(pid, cores used, nice, autogroup id, autogroup nice, hog)``; whether a process was
    squeezed (``job_groups``) is judged by its session's priority against ours."""
    want: dict[tuple[int, int], float] = {}
    weight: dict[tuple[int, int], float] = {}
    for pid, used, nice, group, group_nice, hog in procs:
        key = (group, 0) if group else (0, pid)
        top = group_nice if group else nice
        for threads, each, _ in job_groups(used, top, our_nice, hog):
            want[key] = want.get(key, 0.0) + threads * each
        weight[key] = nice_weight(top)
    return [(1.0, want[k], weight[k]) for k in want]


def fair_level(groups: list[Group], cores: float) -> float:
    """CPU per unit of weight, L, with sum(n * min(want, L * weight)) = cores (inf when
    every want fits): weighted max-min fairness, what CFS converges to.

    50 bisection steps on ``_granted(L) < cores``. A replay calls this twice a tick, and
    the steps were two thirds of a replay's CPU: ``_granted`` is monotone in L (so is
    each float operation in it, for n, weight >= 0), so one evaluation on each side of
    the water level (``_water_level``, the exact solution, +-1e-14) decides every step
    outside that bracket, and only the last few steps evaluate. The steps and the
    result are the plain bisection's, bit for bit."""
    if sum(n * want for n, want, _ in groups) <= cores:
        return float("inf")
    lo, hi = 0.0, max(want / weight for _, want, weight in groups if weight > 0)
    below, above = -1.0, math.inf  # granted < cores up to ``below``, >= from ``above``
    if all(n >= 0 and weight >= 0 for n, _, weight in groups):
        level = _water_level(groups, cores)
        a, b = level * (1 - 1e-14), level * (1 + 1e-14)
        if _granted(groups, a) < cores <= _granted(groups, b):
            below, above = a, b
    for _ in range(50):
        mid = (lo + hi) / 2
        if mid <= below:
            short = True
        elif mid >= above:
            short = False
        else:
            short = _granted(groups, mid) < cores
        lo, hi = (mid, hi) if short else (lo, mid)
    return lo


def _granted(groups: list[Group], level: float) -> float:
    """sum(n * min(want, level * weight)), summed in the groups' order."""
    return sum(n * (x if (x := level * weight) < want else want) for n, want, weight in groups)


def _water_level(groups: list[Group], cores: float) -> float:
    """The level of ``fair_level`` solved directly: groups saturate in the order of
    want / weight, the rest share what is left by weight."""
    order = sorted(groups, key=lambda g: g[1] / g[2] if g[2] > 0 else math.inf)
    # the weights still sharing, summed from the back: subtracting the saturated ones from
    # the total lost the small remainder to cancellation (1024s of ours beside 15s of nice 19)
    rest = [0.0] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        rest[i] = rest[i + 1] + order[i][0] * order[i][2]
    left = cores
    for i, (n, want, weight) in enumerate(order):
        if rest[i] <= 0 or left / rest[i] <= want / weight:
            return left / rest[i] if rest[i] > 0 else 0.0
        left -= n * want
    return 0.0


def erlang_c(servers: int, load: float) -> float:
    """Probability that a job waits in an M/M/c queue (``load`` = arrival rate x mean
    service, in servers; < ``servers``)."""
    term, total = 1.0, 1.0  # load^k / k!, summed for k < servers
    for k in range(1, servers):
        term *= load / k
        total += term
    last = term * load / servers * servers / (servers - load)
    return last / (total + last)


def cpu_slowdown(utilisation: float, cores: float) -> float:
    """Mean response time over CPU time of a short job on ``cores`` busy ``utilisation``
    of the time (M/M/c under processor sharing: ``1 + C(c, A) / (c (1 - rho))``, with A =
    rho c): what a thread that needs less than its fair share still loses, because the
    others' demand comes in bursts and it sometimes finds every core taken."""
    c = max(1, round(cores))
    rho = min(max(utilisation, 0.0), RHO_MAX)
    return 1.0 + erlang_c(c, rho * c) / (c * (1.0 - rho))


def speed(want: float, cpu: float) -> float:
    """How fast an engine runs given ``cpu`` (its share of a core): one that needs less
    runs whenever it is runnable, one that needs more is always runnable and gets it."""
    return 1.0 if want <= cpu else min(1.0, cpu)


@dataclass(frozen=True)
class Host:
    cores: float
    background_t: np.ndarray  # trace clock of each background measurement (sorted)
    background: np.ndarray  # cores other jobs used from that time on
    other_s_per_request: float
    path_s: float  # constant: a hop's few ms of CPU stay under the fair share
    startup_cores: float
    path_s_per_token: float = 0.0  # the path's part that grows with the prompt (JSON, KV)
    other_procs: int = 3  # router, pdserve up, client: non-engine work spreads over them
    # the other jobs as CFS groups per background window (job_groups); empty: they are a
    # fixed load taken off the top (``background``)
    background_groups: tuple[tuple[Group, ...], ...] = ()
    nice: int = 0  # of our processes
    # per background window, the CFS weight our processes compete with at the top level:
    # under autogroup scheduling, that of their autogroups' nice (each worker is its own
    # session, so its own group); empty: their processes' nice (no autogroup)
    our_weights: tuple[float, ...] = ()
    queueing: bool = True  # a prefill's and the path's CPU wait for a core (latency)
    # the stretch (``Cluster.slow_burst``) the idle probe that ``path_s`` comes from ran
    # under: the probe's latency already holds its own wait for a core, so the path is
    # stretched by the ratio (1: as measured on a quiet machine; ``probe_consistent``)
    path_slow: float = 1.0

    def _window(self, t: float) -> int:
        return max(0, int(np.searchsorted(self.background_t, t, side="right")) - 1)

    def _jobs_at(self, t: float) -> tuple[Group, ...]:
        """The other jobs' CFS groups of the window holding ``t``."""
        return self.background_groups[self._window(t)] if self.background_t.size else ()

    def background_at(self, t: float) -> float:
        if self.background.size == 0:
            return 0.0
        return float(self.background[self._window(t)])

    def utilisation(
        self, t: float, engines: list[float], starting: int, request_rate: float
    ) -> float:
        """Share of the cores busy at ``t`` with work that comes in bursts: ``engines`` =
        each engine's mean use (not its runnable time), the non-engine work and the other
        jobs that are not CPU-bound. Starting workers and CPU-bound jobs (always runnable)
        are not bursts: the fair shares (``cpu``) account for them."""
        ours = sum(engines) + request_rate * self.other_s_per_request
        if self.background_groups:
            other = sum(n * want for n, want, _ in self._jobs_at(t) if want < 1.0)
        else:
            other = self.background_at(t)
        return (ours + other) / self.cores

    def cpu(self, t: float, engines: list[float], starting: int, request_rate: float) -> float:
        """The CPU (share of a core) each of our runnable threads gets at ``t`` at most;
        ``engines``: the share each engine with work would use alone (1: always runnable)."""
        w = self.our_weights[self._window(t)] if self.our_weights else nice_weight(self.nice)
        other = request_rate * self.other_s_per_request
        groups: list[Group] = [(1.0, want, w) for want in engines]
        groups.append((float(starting), min(1.0, self.startup_cores), w))
        groups.append((float(self.other_procs), other / self.other_procs, w))
        if self.background_groups:  # the other jobs compete by weight, as CFS has them
            return min(1.0, w * fair_level([*groups, *self._jobs_at(t)], self.cores))
        free = max(self.cores - self.background_at(t), 0.05 * self.cores)
        return min(1.0, w * fair_level(groups, free))
