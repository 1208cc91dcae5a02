"""Scale events and the errors around them, for sim_vs_real_scaling.py.

A scale event is one worker added (+1) or removed (-1) in one pool: on the real side from
``pdserve up``'s log (``started NAME``, ``draining and stopping NAME``: the lines
sim_vs_real_up.py counts replica-seconds from), on the simulated side from the replica
timeline. The trace is cut into ``WINDOW_S`` windows; a window is a *scaling* window
when a scale event of either side touches it: an added worker from its start to its
start-up's end (it loads the model on the shared cores and does not serve yet), a
removed one for one planner interval after. Each request belongs to the window it
arrived in. The TTFT p90 is compared on the requests of scaling windows
(``sim_vs_real_ttft_p90_error_scaling``) and on the rest (``..._steady``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from sim_vs_real_up import EVENT

WINDOW_S = 10.0
DOWN_SPAN_S = 2.0  # a removed worker: one planner interval (sim_vs_real.INTERVAL_S)


@dataclass(frozen=True)
class Event:
    t: float  # trace clock, s
    pool: str  # "prefill" | "decode"
    delta: int  # +1 added, -1 removed


def real_events(log: list, end_s: float) -> list[Event]:
    """From the autoscaler's log lines of real.json (trace clock), within [0, end_s]."""
    out = []
    for t, line in log:
        m = EVENT.search(line)
        if m and m.group(1) and 0 <= float(t) <= end_s:
            pool = m.group(2).split("-")[0]
            out.append(Event(float(t), pool, 1 if m.group(1) == "started" else -1))
    return out


def sim_events(timeline: dict[str, list[float]]) -> list[Event]:
    """From the simulated replica timeline: one event per replica added or removed."""
    out = []
    for pool in ("prefill", "decode"):
        for t, (a, b) in zip(timeline["t"][1:], itertools.pairwise(timeline[pool]), strict=True):
            step = 1 if b > a else -1
            out += [Event(float(t), pool, step)] * abs(int(b) - int(a))
    return sorted(out, key=lambda e: e.t)


def count(events: list[Event]) -> dict[str, int]:
    return {
        "up": sum(e.delta > 0 for e in events),
        "down": sum(e.delta < 0 for e in events),
        "prefill": sum(e.pool == "prefill" for e in events),
        "decode": sum(e.pool == "decode" for e in events),
    }


def scaling_windows(events: list[Event], startup_s: float, end_s: float) -> np.ndarray:
    """Per ``WINDOW_S`` window of [0, end_s): whether a scale event touches it."""
    n = int(np.ceil(end_s / WINDOW_S))
    hit = np.zeros(n, dtype=bool)
    for e in events:
        span = startup_s if e.delta > 0 else DOWN_SPAN_S
        first, last = int(e.t // WINDOW_S), int(min(e.t + span, end_s - 1e-9) // WINDOW_S)
        hit[max(first, 0) : min(last, n - 1) + 1] = True
    return hit


def in_windows(arrival: np.ndarray, hit: np.ndarray) -> np.ndarray:
    """Whether each arrival falls in a marked window."""
    idx = np.clip((arrival // WINDOW_S).astype(int), 0, hit.size - 1)
    return hit[idx]


def p90(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.percentile(x, 90)) if x.size else float("nan")


def error(sim: float, real: float) -> float:
    if not (np.isfinite(sim) and np.isfinite(real)) or real <= 0:
        return float("inf")
    return round(abs(sim - real) / real, 4)


def split_errors(
    real_arrival: np.ndarray,
    real_ttft: np.ndarray,
    sim_arrival: np.ndarray,
    sim_ttft: np.ndarray,
    hit: np.ndarray,
) -> dict[str, Any]:
    """TTFT p90, real and simulated, in scaling and in steady windows, and their errors."""
    out: dict[str, Any] = {}
    for name, want in (("scaling", True), ("steady", False)):
        r = real_ttft[in_windows(real_arrival, hit) == want]
        s = sim_ttft[in_windows(sim_arrival, hit) == want]
        rp, sp = p90(r), p90(s)
        out[f"sim_vs_real_ttft_p90_error_{name}"] = error(sp, rp)
        out[name] = {
            "requests_real": int(np.isfinite(r).sum()),
            "requests_sim": int(s.size),
            "ttft_p90_real_s": round(rp, 4),
            "ttft_p90_sim_s": round(sp, 4),
        }
    out["windows"] = {"size_s": WINDOW_S, "scaling": int(hit.sum()), "all": int(hit.size)}
    return out
