"""The P:D split as a decision: disaggregated mix vs colocation (no prefill pool)."""

from __future__ import annotations

import pytest
from planner_helpers import T0, config, settled, snap

from pdserve.planner.config import SLO, Bounds
from pdserve.planner.decision import PlannerState
from pdserve.planner.mix import COLOCATED, DISAGGREGATED, choose_mix, decide_mode, disagg_rates
from pdserve.planner.plan import plan

pytestmark = pytest.mark.unit


def test_short_prompts_with_a_loose_tpot_are_colocated() -> None:
    choice = choose_mix(config(slo=SLO(1.0, 0.1)), prompt=256, output=200)
    assert choice.mode == COLOCATED and choice.prefill_share == 0.0
    assert choice.colocated_goodput > choice.disagg_goodput
    assert "decode workers prefill locally" in choice.reason


def test_long_prompts_with_a_strict_tpot_are_disaggregated() -> None:
    cfg = config(slo=SLO(2.0, 0.012), ttft_headroom=1.0, tpot_headroom=1.0)
    choice = choose_mix(cfg, prompt=8000, output=500)
    assert choice.mode == DISAGGREGATED
    assert choice.disagg_goodput > 2 * choice.colocated_goodput
    r_p, r_d = disagg_rates(cfg, 8000, 500)
    assert choice.prefill_share == pytest.approx(r_d / (r_p + r_d))
    assert 0.3 < choice.prefill_share < 0.7  # prefill and decode replicas about as fast


def test_colocation_needs_an_empty_prefill_pool_to_be_allowed() -> None:
    cfg = config(slo=SLO(1.0, 0.1))  # prefill Bounds(1, 100): the pool cannot be empty
    _, mode, why = decide_mode(cfg, 256, 200, DISAGGREGATED)
    assert mode == DISAGGREGATED and "not applied: prefill minReplicas > 0" in why


def test_a_close_call_does_not_switch_modes() -> None:
    cfg = config(slo=SLO(1.0, 0.1), prefill=Bounds(0, 100))
    choice, mode, why = decide_mode(cfg, 256, 200, DISAGGREGATED)
    ratio = choice.colocated_goodput / choice.disagg_goodput
    assert (mode == COLOCATED) == (ratio >= 1.05), (ratio, why)


def test_plan_runs_colocated_without_a_prefill_pool() -> None:
    cfg = config(slo=SLO(1.0, 0.1), prefill=Bounds(0, 100))
    state, pools = settled(), ((10, 10, 0), (10, 10, 0))
    for i in range(3):
        s = snap(T0 + 10 * i, *pools, rps=150, prompt=256, output=200, decode_running=600)
        decision, state = plan(s, state, cfg)
        if i == 0:
            assert decision.prefill.desired == 5  # down at once (-50% per decision)
        p, d = decision.prefill.desired, decision.decode.desired
        pools = ((p, p, 0), (d, d, 0))
    assert decision.mode == COLOCATED and state.mode == COLOCATED
    assert decision.prefill.need == 0.0
    assert decision.prefill.desired == 5  # held by the scale-down cooldown after that
    g = decision.details["mix_colocated_goodput_per_replica"]
    assert decision.decode.need >= 150 / g - 0.01  # the decode pool takes the whole rate
    assert "colocated" in decision.reason
    again = PlannerState.from_dict(state.to_dict())
    assert again.mode == COLOCATED
