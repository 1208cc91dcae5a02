"""``spec.slo.targetAttainment`` steers the planner: the percentile it sizes for follows it.

Before this, the field was parsed and rendered but no planner code read it, so two
LLMServices that differed only in it got the same decisions: the first test fails there.
"""

from __future__ import annotations

import math

import pytest
from planner_helpers import config, settled, snap

from pdserve.operator.autoscale_inputs import planner_config
from pdserve.operator.spec_parse import parse_llmservice
from pdserve.planner.config import SLO, PlannerConfigError
from pdserve.planner.plan import plan
from pdserve.planner.presets import H100_LLAMA3_8B
from pdserve.planner.tail import tpot_scale, ttft_scale

pytestmark = pytest.mark.unit


def _with_target(q: float):  # type: ignore[no-untyped-def]
    # a 20 ms TPOT target: the batch per replica is set by TPOT, not by max_num_seqs
    return config(slo=SLO(ttft_s=1.0, tpot_s=0.02, target_attainment=q))


def test_same_load_two_targets_two_decisions() -> None:
    """p99 sizes both pools larger than p90 on one snapshot: a planner that ignores the
    target (the bug) gives equal decisions and fails here. 3x the helpers' default request
    rate on 10 prefill + 40 decode replicas: both targets scale both pools up, to counts
    the stability rules do not cap."""
    s = snap(rps=300.0, decode=(40, 40, 0), decode_running=4800.0)
    state = settled(10, 40)
    p90, _ = plan(s, state, _with_target(0.9))
    p99, _ = plan(s, state, _with_target(0.99))
    assert p99.prefill.desired > p90.prefill.desired, (p90.prefill, p99.prefill)
    assert p99.decode.desired > p90.decode.desired, (p90.decode, p99.decode)
    # the model's terms say why: a lower utilisation target, a smaller batch per replica
    d90, d99 = p90.details, p99.details
    assert d99["prefill_target_utilisation"] < d90["prefill_target_utilisation"]
    assert d99["decode_batch_per_replica"] < d90["decode_batch_per_replica"]


def test_default_target_plans_as_before() -> None:
    """The headrooms stand for p90 (what the presets and recordings were sized with), so
    the default target keeps every earlier decision: the budgets are the plain products."""
    cfg = config()
    assert cfg.slo.target_attainment == 0.9
    assert cfg.ttft_budget_s == pytest.approx(cfg.ttft_headroom * cfg.slo.ttft_s)
    assert cfg.tpot_budget_s == pytest.approx(cfg.tpot_headroom * cfg.slo.tpot_s)


def test_tail_shapes() -> None:
    """TTFT (M/M/1 response, exponential): p99 is ln(100) / ln(10) = 2x p90's multiple of
    the mean, so the budget halves. TPOT (a mean over many steps, narrow): it shrinks by
    far less. A looser target (p75) loosens both."""
    assert ttft_scale(0.99) == pytest.approx(0.5)
    assert 0.8 < tpot_scale(0.99) < 0.95
    assert ttft_scale(0.75) > 1 and tpot_scale(0.75) > 1
    assert math.isfinite(ttft_scale(1.0))  # the CRD allows 1: sized as p99.9


def test_slo_refuses_out_of_range_target() -> None:
    with pytest.raises(PlannerConfigError, match="target_attainment"):
        SLO(1.0, 0.05, target_attainment=0.3)


def test_operator_passes_spec_target_to_planner() -> None:
    """LLMService spec -> planner config: the operator's path, not only the dataclass."""

    def svc(q: float):  # type: ignore[no-untyped-def]
        body = {
            "model": {"source": {"hostPath": {"path": "/data/models/tiny"}}},
            "slo": {"ttftMs": 1000, "tpotMs": 50, "targetAttainment": q},
        }
        obj = {
            "apiVersion": "pdserve.io/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": body,
        }
        return planner_config(parse_llmservice(obj), H100_LLAMA3_8B)

    lo, hi = svc(0.9), svc(0.99)
    assert (lo.slo.target_attainment, hi.slo.target_attainment) == (0.9, 0.99)
    assert hi.ttft_budget_s < lo.ttft_budget_s and hi.tpot_budget_s < lo.tpot_budget_s
