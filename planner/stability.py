"""Stability rules that turn a pool's raw need into a replica count.

In order: manual edits are adopted; the need is clamped to the bounds; scale-up
is immediate (limited per step) unless pods are pending for lack of
accelerators; scale-down goes to the largest recommendation of the
stabilization window, only after the cooldown and beyond the tolerance, and
removes unready pods first; never below the forecast's need for the next
start-up time (``PoolInput.floor``), nor while the load's recent fitted slope is
positive beyond one standard error (``PoolInput.rising``: not into a ramp too young or
too slow to forecast); and a scale-down that would cancel a pod still
starting waits until the need has stayed below the count for ``unready_hold_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.planner.config import Bounds, Stability
from pdserve.planner.decision import PoolDecision, PoolMemory
from pdserve.planner.snapshot import PoolStatus


@dataclass(frozen=True)
class PoolInput:
    role: str
    need: float  # replicas for this interval's load, including any backlog to drain
    status: PoolStatus
    bounds: Bounds
    memory: PoolMemory
    now: float
    steady_need: float | None = None  # without the transient backlog terms; None: = need
    floor: float = 0.0  # a scale-down never goes below this (what the forecast needs next)
    rising: bool = False  # the load's recent fitted slope is positive (forecast.UPTREND_Z)


def stabilize(inp: PoolInput, stab: Stability) -> tuple[PoolDecision, PoolMemory]:
    status, mem, bounds = inp.status, inp.memory, inp.bounds
    if mem.last_scale_s is None:  # first decision (or lost state): start the cooldown now
        mem = replace(mem, last_scale_s=inp.now)
    recommendation = bounds.clamp(math.ceil(inp.need - 1e-9))
    edited = mem.last_target is not None and status.current != mem.last_target
    if edited and bounds.min_replicas <= status.current <= bounds.max_replicas:
        # A person (or another tool) changed the count: adopt it for this interval and
        # restart the window from it, so the planner does not fight the edit.
        mem = PoolMemory(
            last_target=status.current, last_scale_s=inp.now, history=((inp.now, status.current),)
        )
        why = f"manual edit to {status.current} respected (need {inp.need:.1f})"
        return _decide(inp, status.current, why), mem
    # The window remembers steady-state needs only: a backlog-drain or trend boost is
    # transient and must not hold the pool up for a whole window once it is gone.
    steady = inp.need if inp.steady_need is None else min(inp.need, inp.steady_need)
    kept = _window(mem.history, inp.now, stab.scale_down_window_s)
    history = (*kept, (inp.now, bounds.clamp(math.ceil(steady - 1e-9))))
    below = recommendation < status.current
    since = (mem.below_since if mem.below_since is not None else inp.now) if below else None
    mem = replace(mem, history=history, below_since=since)
    if status.current < bounds.min_replicas or status.current > bounds.max_replicas:
        target = bounds.clamp(status.current)
        why = f"{status.current} is outside [{bounds.min_replicas}, {bounds.max_replicas}]"
        return _apply(inp, mem, target, why)
    if recommendation > status.current:
        return _scale_up(inp, mem, recommendation, stab)
    if recommendation < status.current:
        return _scale_down(inp, mem, stab)
    return _decide(inp, status.current, f"steady (need {inp.need:.1f})"), _hold(mem, status)


def _scale_up(
    inp: PoolInput, mem: PoolMemory, recommendation: int, stab: Stability
) -> tuple[PoolDecision, PoolMemory]:
    current = inp.status.current
    if inp.status.pending > 0:
        why = (
            f"need {inp.need:.1f} but {inp.status.pending} pod(s) pending (no free accelerator): "
            "not scaling up behind them"
        )
        return _decide(inp, current, why), _hold(mem, inp.status)
    if inp.need <= current * (1 + stab.tolerance):
        return _decide(inp, current, f"need {inp.need:.1f} within tolerance"), _hold(
            mem, inp.status
        )
    if mem.last_up_s is not None and inp.now - mem.last_up_s < stab.scale_up_cooldown_s:
        return _decide(inp, current, "scale-up cooldown"), _hold(mem, inp.status)
    limit = max(math.ceil(current * stab.max_up_factor), current + stab.min_up_step)
    target = min(recommendation, limit)
    why = f"scale up {current}->{target}: need {inp.need:.1f}"
    if target < recommendation:
        why += f" (step limited from {recommendation})"
    return _apply(inp, mem, target, why)


def _scale_down(
    inp: PoolInput, mem: PoolMemory, stab: Stability
) -> tuple[PoolDecision, PoolMemory]:
    current = inp.status.current
    stabilized = max(n for _, n in mem.history)
    if stabilized >= current:
        why = (
            f"need {inp.need:.1f}; scale-down held: window max {stabilized} "
            f"over {stab.scale_down_window_s:.0f}s"
        )
        return _decide(inp, current, why), _hold(mem, inp.status)
    if mem.last_scale_s is not None and inp.now - mem.last_scale_s < stab.scale_down_cooldown_s:
        return _decide(inp, current, f"need {inp.need:.1f}; scale-down cooldown"), _hold(
            mem, inp.status
        )
    if current - stabilized < max(1.0, current * stab.tolerance) and inp.status.unready == 0:
        return _decide(inp, current, f"need {inp.need:.1f} within tolerance"), _hold(
            mem, inp.status
        )
    held = _unready_held(inp, mem, stab)
    if held:
        return _decide(inp, current, held), _hold(mem, inp.status)
    if inp.rising:
        why = f"need {inp.need:.1f}; scale-down held: the load is rising (recent fitted slope)"
        return _decide(inp, current, why), _hold(mem, inp.status)
    floor = math.ceil(inp.floor - 1e-9)
    if floor >= current:
        why = f"need {inp.need:.1f}; scale-down held: the forecast needs {inp.floor:.1f} next"
        return _decide(inp, current, why), _hold(mem, inp.status)
    step = max(1, math.floor(current * stab.max_down_step_fraction))
    target = max(stabilized, current - step, floor)
    return _apply(inp, mem, target, f"scale down {current}->{target}: need {inp.need:.1f}")


def _unready_held(inp: PoolInput, mem: PoolMemory, stab: Stability) -> str:
    """Why a scale-down is held for the pods still starting ("" if it is not): it would
    remove them first, and the need has not yet stayed below the count for the hold."""
    if inp.status.unready == 0 or stab.unready_hold_s <= 0 or mem.below_since is None:
        return ""
    below_s = inp.now - mem.below_since
    if below_s >= stab.unready_hold_s:
        return ""
    return (
        f"need {inp.need:.1f}; scale-down held: {inp.status.unready} pod(s) still starting, "
        f"need below the count for {below_s:.0f}s of {stab.unready_hold_s:.0f}s"
    )


def _apply(
    inp: PoolInput, mem: PoolMemory, target: int, why: str
) -> tuple[PoolDecision, PoolMemory]:
    current = inp.status.current
    remove_unready = min(current - target, inp.status.unready) if target < current else 0
    if remove_unready:
        why += f"; removes {remove_unready} unready pod(s) first"
    up = inp.now if target > current else mem.last_up_s
    mem = replace(mem, last_target=target, last_scale_s=inp.now, last_up_s=up)
    return _decide(inp, target, why, remove_unready), mem


def _hold(mem: PoolMemory, status: PoolStatus) -> PoolMemory:
    return replace(mem, last_target=status.current)


def _decide(inp: PoolInput, target: int, why: str, remove_unready: int = 0) -> PoolDecision:
    return PoolDecision(
        role=inp.role,
        current=inp.status.current,
        desired=target,
        need=round(inp.need, 3),
        remove_unready=remove_unready,
        reason=why,
    )


def _window(history: tuple[tuple[float, int], ...], now: float, window: float) -> tuple:
    return tuple((t, n) for t, n in history if now - t < window)
