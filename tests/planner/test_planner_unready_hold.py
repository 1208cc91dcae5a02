"""Hysteresis for starting pods: a scale-down does not cancel a worker that is still
starting unless the need has stayed below the count for ``unready_hold_s``.

Before it, ``pdserve up --autoscale`` (a 10 s scale-down window, 5 s cooldown) started
workers on one interval's forecast and cancelled them 6-8 s later when the next
interval's need dipped (bench/recordings/sim_vs_real/2026-12-01-0433-full: three such pairs).
Pure planner calls, no processes.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from pdserve.local.planner_loop import config_from_args
from pdserve.local.up import add_arguments
from pdserve.planner.config import Bounds, Stability
from pdserve.planner.decision import PlannerState, PoolMemory
from pdserve.planner.snapshot import PoolStatus
from pdserve.planner.stability import PoolInput, stabilize

pytestmark = pytest.mark.unit

FAST = Stability(scale_down_window_s=10.0, scale_down_cooldown_s=5.0)  # pdserve up's own


def _step(mem: PoolMemory, now: float, need: float, unready: int, stab: Stability):  # type: ignore[no-untyped-def]
    status = PoolStatus(current=3, ready=3 - unready)
    inp = PoolInput("decode", need, status, Bounds(1, 4), replace(mem, last_target=3), now)
    return stabilize(inp, stab)


def _scaled_up_at_zero() -> PoolMemory:
    """3 workers, 1 of them ordered at t=0 on a need of 2.6 and still starting."""
    return PoolMemory(last_target=3, last_scale_s=0.0, last_up_s=0.0, history=((0.0, 3),))


def _first_scale_down(stab: Stability, needs: list[float], unready: int = 1) -> float | None:
    mem = _scaled_up_at_zero()
    for k, need in enumerate(needs):
        dec, mem = _step(mem, 2.0 * (k + 1), need, unready, stab)
        if dec.desired < 3:
            assert dec.remove_unready == min(unready, 3 - dec.desired)
            return 2.0 * (k + 1)
    return None


def test_without_a_hold_a_starting_worker_is_cancelled_seconds_after_its_order() -> None:
    dip = [1.5] * 20  # the need falls to 1.5 right after the order
    assert _first_scale_down(FAST, dip) == 10.0  # once the 10 s window has let go of it


def test_the_hold_keeps_a_starting_worker_until_the_need_stays_below() -> None:
    held = replace(FAST, unready_hold_s=30.0)
    # the need dips below 3 at 2 s and stays there: cancelled once it has for 30 s
    assert _first_scale_down(held, [1.5] * 30) == 32.0
    # a need back at the count (3.2: within tolerance, no scale-up) restarts the clock
    needs = [1.5] * 10 + [3.2] + [1.5] * 30
    assert _first_scale_down(held, needs) == 22.0 + 2.0 + 30.0
    # with every worker ready the hold does not apply: the usual window and cooldown
    assert _first_scale_down(held, [1.5] * 20, unready=0) == 10.0


def test_the_hold_survives_the_state_round_trip_and_is_a_pdserve_up_flag() -> None:
    mem = replace(_scaled_up_at_zero(), below_since=4.0)
    state = PlannerState(decode=mem)
    assert PlannerState.from_dict(state.to_dict()).decode.below_since == 4.0
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = config_from_args(parser.parse_args([]))
    assert default.stability.unready_hold_s == 30.0
    off = config_from_args(parser.parse_args(["--unready-hold", "0"]))
    assert off.stability.unready_hold_s == 0.0
