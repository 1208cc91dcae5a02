"""The host model's inputs (planner/sim/host.py), from what the real replay measured
(sim_vs_real.py).

``dump`` is what sim_vs_real_up.py wrote beside the run (``real.json``): /proc CPU
samples of every process on the trace clock (the first from ``pdserve up``'s launch),
the autoscaler's log lines and the idle probe's TTFTs. Nothing here looks at the
replay's latencies: the inputs are CPU seconds, the core count and the idle probe.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import re
from dataclasses import replace

import numpy as np

from pdserve.planner.capacity import Profile
from pdserve.planner.sim.host import (
    Host,
    autogroup_entities,
    cpu_slowdown,
    is_hog,
    job_groups,
    nice_weight,
    speed,
)

READY = re.compile(r"autoscaler: (\S+) ready")
STOPPED = re.compile(r"autoscaler: (?:\w+: )?draining and stopping (\S+)")
# the other jobs per sampling period (CpuSampler's 0.5 s), not averaged over longer: they
# come in bursts, and a nice-19 engine waits whenever one is runnable on its core (2 s
# windows gave the 04:33 recording's engine 0.24 of a core where /proc says 0.10)
WINDOW_S = 0.5
FRONT = ("router", "up", "client")  # the rest of our processes are workers


def cores() -> float:
    if hasattr(os, "sched_getaffinity"):  # the cores this process may run on
        return float(len(os.sched_getaffinity(0)))
    return float(os.cpu_count() or 1)


def _ready_times(log: list) -> dict[str, float]:
    out: dict[str, float] = {}
    for t, line in log:
        m = READY.search(line)
        if m:
            out.setdefault(m.group(1), float(t))
    return out


def _added(log: list) -> set[str]:
    """The workers the planner started during the run (``started NAME`` lines)."""
    from sim_vs_real_up import EVENT

    return {m.group(2) for _, line in log if (m := EVENT.search(line)) and m.group(1) == "started"}


def _deltas(samples: list[dict]) -> list[tuple[float, float, dict[str, float]]]:
    """(start, length, CPU seconds per process and 'machine') of each sampling period; a
    process that vanished counts 0 (its exit loses its last CPU; clipped at 0)."""
    out = []
    for a, b in itertools.pairwise(samples):
        d = {k: max(0.0, b[k] - a.get(k, b[k])) for k in b if k != "t"}
        out.append((a["t"], b["t"] - a["t"], d))
    return out


def _background(dump: dict, end_s: float, window_s: float = WINDOW_S) -> tuple[np.ndarray, ...]:
    """Cores the other jobs used (machine busy minus our processes), per ``window_s``."""
    edges = np.arange(0.0, end_s + window_s, window_s)
    used, span = np.zeros(edges.size), np.zeros(edges.size)
    for t, dt, d in _deltas(dump["cpu"]):
        if 0 <= t < end_s:
            i = int(t // window_s)
            ours = sum(v for k, v in d.items() if "/" not in k and k != "machine")
            used[i] += max(0.0, d["machine"] - ours)
            span[i] += dt
    keep = span > 0
    return edges[keep], used[keep] / span[keep]


def _jobs(
    dump: dict, end_s: float, our_nice: int, window_s: float = WINDOW_S, ours: tuple = ()
) -> tuple[tuple, ...]:
    """The other jobs' processes as CFS groups (sim.host.job_groups), per ``window_s`` of
    the trace, on the windows ``_background`` keeps (those with a sampling period). With
    ``ours`` (our autogroups' nice per kept window: ``_our_groups``) the recording's
    autogroups are used: one CFS entity per session (sim.host.autogroup_entities)."""
    edges = np.arange(0.0, end_s + window_s, window_s)
    used: list[dict[int, float]] = [{} for _ in edges]
    about: dict[int, tuple[int, ...]] = {}  # pid -> (nice[, autogroup id, autogroup nice])
    span = np.zeros(edges.size)
    for (t, _), (t_next, procs) in itertools.pairwise(dump.get("others", [])):
        if 0 <= t < end_s:  # sample k holds the CPU since sample k-1: this period's
            i = int(t // window_s)
            span[i] += t_next - t
            for pid, cpu, *rest in procs:
                used[i][pid] = used[i].get(pid, 0.0) + cpu
                about[pid] = tuple(rest)
    kept = np.flatnonzero(span > 0)
    per_pid: dict[int, list[float]] = {}
    for i in kept.tolist():
        for pid, c in used[i].items():
            per_pid.setdefault(pid, []).append(c / span[i])
    hogs = {pid for pid, u in per_pid.items() if is_hog(u, kept.size)}
    if ours:
        return tuple(
            tuple(
                autogroup_entities(
                    [(pid, c / span[i], *about[pid], pid in hogs) for pid, c in used[i].items()],
                    our,
                )
            )
            for i, our in zip(kept, ours, strict=True)
        )
    return tuple(
        tuple(
            g
            for pid, c in used[i].items()
            for g in job_groups(c / span[i], about[pid][0], our_nice, pid in hogs)
        )
        for i in kept
    )


def _our_groups(dump: dict, kept_t: np.ndarray, window_s: float = WINDOW_S) -> tuple[int, ...]:
    """Our workers' autogroup nice per kept window (the most common among the workers
    sampled in it; the one before where none was), or () when the recording has no
    autogroups (older ones) or the kernel did not schedule by them."""
    samples = dump.get("groups")
    others = dump.get("others", [])
    complete = all(len(p) == 5 for _, procs in others for p in procs)
    if not dump.get("autogroup") or not samples or not complete:
        return ()
    per_window: dict[int, list[int]] = {}
    for t, roles in samples:
        workers = [n for role, n in roles.items() if role not in FRONT]
        per_window.setdefault(int(t // window_s), []).extend(workers)
    out, last = [], int(dump.get("nice", {}).get("up", 0))
    for t in kept_t:
        seen = per_window.get(round(t / window_s), [])
        last = max(set(seen), key=seen.count) if seen else last
        out.append(last)
    return tuple(out)


def measure_host(
    dump: dict, profile: Profile, requests: int, end_s: float, autogroup: bool = True
) -> Host:
    """``autogroup=False``: the per-process model even where the recording has autogroups
    (sim_vs_real.py reports both, to show what the sessions change)."""
    ready = _ready_times(dump["log"])
    # with a core zygote the first workers' start-ups waited on its imports (which no
    # worker's CPU holds); the added workers' are the start-ups the simulator has
    added = _added(dump["log"]) if dump.get("core_zygote") else set()
    startup_cpu, startup_s, other = 0.0, 0.0, 0.0
    for t, dt, d in _deltas(dump["cpu"]):
        for w in (k for k in d if "/" not in k and k not in (*FRONT, "machine")):
            if t < ready.get(w, float("inf")):  # starting: model load, warm-up
                if added and w not in added:
                    continue
                startup_cpu += d[w]
                startup_s += dt
            elif 0 <= t < end_s:  # serving: all but the engine thread
                other += max(0.0, d[w] - d.get(w + "/engine", 0.0))
        if 0 <= t < end_s:
            other += sum(d.get(k, 0.0) for k in FRONT)
    probe = probe_pairs(dump)
    path = [x - profile.prefill.service_time(n) for x, n in probe]
    fixed, per_token = _path_fit(path, [n for _, n in probe], "probe_lengths" in dump)
    bg_t, bg = _background(dump, end_s)
    nice = int(dump.get("nice", {}).get("up", 0))
    ours = _our_groups(dump, bg_t) if autogroup else ()
    jobs = _jobs(dump, end_s, nice, ours=ours)  # the same sampling periods: the same windows
    return Host(
        cores=float(dump.get("cores") or cores()),  # the recorded machine's, when replayed
        background_t=bg_t,
        background=bg,
        other_s_per_request=other / max(requests, 1),
        path_s=fixed,
        path_s_per_token=per_token,
        startup_cores=startup_cpu / startup_s if startup_s > 0 else 0.0,
        background_groups=jobs if len(jobs) == bg_t.size else (),
        nice=nice,
        our_weights=tuple(nice_weight(n) for n in ours) if len(jobs) == bg_t.size else (),
    )


# a request that waited this long for its first token found the prefill engines with work
# queued ahead of it the whole time (its own prefill and the path take well under 1 s even
# at a tenth of a core: the idle probe's 512 tokens, 0.15-0.35 s at load average 18)
BACKLOG_S = 1.0
MIN_BACKLOG_S = 10.0  # engine-seconds of backlog needed to trust the share measured in it


def backlogged_share(
    dump: dict, arrival: np.ndarray, ttft: np.ndarray, end_s: float
) -> tuple[float, float]:
    """The share of a core one of our prefill engines got while it always had work (its
    engine thread's CPU over the sampling periods inside a backlog: a request that waited
    over ``BACKLOG_S`` for its first token was queued behind others from its arrival to a
    ``BACKLOG_S`` before its first token), and the engine-seconds it was measured over.
    A thread that is always runnable gets the scheduler's fair share of whatever else runs:
    what the simulated engines meet when a queue builds (scale-ups are for that)."""
    cpu, seconds = 0.0, 0.0
    for _, _, used, engine_s in _queued_periods(dump, arrival, ttft, end_s):
        cpu += used
        seconds += engine_s
    return (cpu / seconds if seconds > 0 else 0.0), seconds


def backlogged_cost(
    dump: dict,
    arrival: np.ndarray,
    ttft: np.ndarray,
    prompt: np.ndarray,
    end_s: float,
    profile: Profile,
) -> tuple[float, int]:
    """The prefill engines' CPU per request served while queued, over what the profile
    says those requests cost (its fluid work: the simulator's), and how many were served.
    The profile is CPU time on an idle engine; on a machine at load average 25-28 the same
    prefills took 1.4-1.55x that (20 threads on 2 cores evict each other's caches), at
    15-20 1.0-1.07x (bench/recordings/sim_vs_real_scaling/README.md)."""
    p = profile.prefill
    per_token = p.chunk_overhead_s / p.chunk_tokens + 1 / p.tokens_per_s
    first = arrival + ttft
    cpu, work, served = 0.0, 0.0, 0
    for t, dt, used, _ in _queued_periods(dump, arrival, ttft, end_s):
        done = np.isfinite(first) & (first >= t) & (first < t + dt)
        cpu += used
        work += float(
            (per_token * prompt[done] + p.attention_s_per_token_sq * prompt[done] ** 2).sum()
        )
        served += int(done.sum())
    return (cpu / work if work > 0 else 1.0), served


def _queued_periods(dump: dict, arrival: np.ndarray, ttft: np.ndarray, end_s: float):  # type: ignore[no-untyped-def]
    """(start, length, engine CPU, engine-seconds) of each sampling period inside a
    backlog, over the ready and not draining prefill workers' engine threads."""
    slow = np.isfinite(ttft) & (ttft > BACKLOG_S)
    spans = _union(list(zip(arrival[slow], arrival[slow] + ttft[slow] - BACKLOG_S, strict=True)))
    ready = _ready_times(dump["log"])
    gone = {name: float(t) for t, line in dump["log"] for name in _stopped(line)}
    for t, dt, d in _deltas(dump["cpu"]):
        if not (t >= 0 and t + dt <= end_s and _inside(spans, t, t + dt)):
            continue
        cpu, seconds = 0.0, 0.0
        for key, used in d.items():
            name = key.split("/")[0]
            if (
                key.startswith("prefill")
                and key.endswith("/engine")
                and (ready.get(name, float("inf")) <= t and gone.get(name, float("inf")) > t + dt)
            ):
                cpu += used
                seconds += dt
        yield t, dt, cpu, seconds


def _stopped(line: str) -> list[str]:
    m = STOPPED.search(line)
    return [m.group(1)] if m else []


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out


def _inside(spans: list[tuple[float, float]], a: float, b: float) -> bool:
    """Whether [a, b] lies inside one of ``spans`` (disjoint, sorted: ``_union``)."""
    i = bisect.bisect_right(spans, (a, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= a and b <= spans[i][1]


def runnable_threads(host: Host, share: float) -> Host:
    """The other jobs as always-runnable threads, as many as leave a CPU-bound thread of
    ours ``share`` of a core (``backlogged_share``): ``background / share`` of them, a
    constant (the mean over the run), at our weight.

    Why: on a saturated machine (load average 15-24 on 2 cores) the other jobs are many
    processes that each used little because each was squeezed; counted as wanting what
    they used (``job_groups``: none of them a hog), they left the simulated engines 0.4-1.0
    of a core where the real engine got 0.08-0.12. The share a CPU-bound thread of ours
    got is measured directly instead. A constant, not the run's 0.5 s timeline: another
    run's other jobs do not burst at the same seconds of the trace."""
    if share <= 0 or host.background.size == 0:
        return host
    w = float(np.mean(host.our_weights)) if host.our_weights else nice_weight(host.nice)
    threads = float(host.background.mean()) / share
    one = np.array([0.0])
    return replace(
        host,
        background_t=one,
        background=np.array([float(host.background.mean())]),
        background_groups=(((threads, 1.0, w),),),
        our_weights=(w,),
    )


def probe_consistent(host: Host, dump: dict, profile: Profile) -> Host:
    """The serving path refit so that the simulator gives the idle probe back: the probe's
    TTFT is its prefill stretched by the host model's ``slow_burst`` at the probe (one
    request at a time on an idle service, ~3 req/s) plus the path measured at that stretch
    (``Host.path_slow``). ``measure_host`` subtracts the prefill's CPU time alone: on a
    quiet machine the same (stretch ~1); on a saturated one the probe's 0.1-0.35 s hold the
    prefill's wait for a core, which the simulator then added again (x 4-8)."""
    rate = 1.0 / 0.3  # the probe: one request, 0.2 s of sleep, the next
    share = speed(1.0, host.cpu(0.0, [1.0, 0.0], 0, rate))
    slow = max(1.0 / share, cpu_slowdown(host.utilisation(0.0, [0.0, 0.0], 0, rate), host.cores))
    probe = probe_pairs(dump)
    path = [x - profile.prefill.service_time(n) * slow for x, n in probe]
    fixed, per_token = _path_fit(path, [n for _, n in probe], "probe_lengths" in dump)
    return replace(host, path_s=fixed, path_s_per_token=per_token, path_slow=slow)


def probe_pairs(dump: dict) -> list[tuple[float, int]]:
    """The idle probe's (TTFT, prompt length) pairs, less the first (a warm-up)."""
    from sim_vs_real_up import PROBE_LENGTHS  # recordings without their own list

    lengths = dump.get("probe_lengths", PROBE_LENGTHS)
    return list(zip(dump["probe"], lengths, strict=False))[1:]


def _path_fit(path: list[float], lengths: list[int], medians: bool = False) -> tuple[float, float]:
    """The idle path's latency as fixed + per prompt token (least squares, both >= 0):
    the JSON of the prompt's ids and its KV hand-off grow with it. ``medians``: fit each
    length's median (the probes since 2026-12-04 17:10: 7 per length), so one slow probe
    does not tilt the slope; the recordings before keep the fit they were scored with."""
    median = max(0.0, float(np.median(path))) if path else 0.0
    if len(set(lengths)) < 2:
        return median, 0.0
    x, y = np.asarray(lengths, float), np.asarray(path)
    if medians:
        x = np.unique(x)
        y = np.array([np.median(y[np.asarray(lengths) == n]) for n in x])
    slope, fixed = np.polyfit(x, y, 1)
    return (max(0.0, float(fixed)), float(slope)) if slope > 0 else (median, 0.0)


def _hogs(host: Host) -> dict[str, float]:
    """The other jobs' always-runnable threads per window (mean), by nice level."""
    out: dict[str, float] = {}
    for window in host.background_groups:
        for threads, want, weight in window:
            if want >= 1.0:  # (under autogroup: a session, its cores wanted)
                nice = str(round(math.log(1024.0 / weight, 1.25)))
                out[nice] = out.get(nice, 0.0) + threads * want
    n = max(len(host.background_groups), 1)
    return {k: round(v / n, 2) for k, v in sorted(out.items())}


def describe(host: Host) -> dict:
    bg = host.background
    return {
        "cores": host.cores,
        "background_cores_mean": round(float(bg.mean()), 3) if bg.size else 0.0,
        "other_cpu_ms_per_request": round(host.other_s_per_request * 1e3, 2),
        "path_ms": round(host.path_s * 1e3, 1),
        "path_us_per_token": round(host.path_s_per_token * 1e6, 2),
        "startup_cores": round(host.startup_cores, 3),
        "nice": host.nice,
        # our autogroups' weight, mean over the trace (None: by process nice, no autogroup)
        "autogroup_weight": round(float(np.mean(host.our_weights)), 1)
        if host.our_weights
        else None,
        "background_hogs_by_nice": _hogs(host),  # CFS groups the simulated workers meet
    }
