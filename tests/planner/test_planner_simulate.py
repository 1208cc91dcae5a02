"""bench/simulate.py --quick as a subprocess: one JSON line last, two plots, every
scenario and policy present with figures of the right kind (issue 45: the figures' bounds
are the bench's own, ``simulate.py --check``, bench/simulate_check.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import simulate_check

from pdserve.testing.loopback import run_bench

pytestmark = pytest.mark.bench

POLICIES = {"planner", "queue_blind", "static"}


def _share(x: object) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


@pytest.mark.timeout(600)
def test_simulate_quick_prints_the_json_line_and_a_plot(tmp_path: Path) -> None:
    args = ("--quick", "--no-progress", "--out-dir", str(tmp_path))
    result = run_bench("simulate.py", *args, timeout=590)
    assert result["quick"] is True and result["trace_scale"] == 0.1
    for key in ("attainment_min", "queue_blind_attainment", "static_attainment"):
        assert _share(result[key]), key
    assert math.isfinite(result["replica_hours_saving_min"])
    groups = {
        "scenarios": {"diurnal", "burst", "long_prompt_surge"},
        "heldout_scenarios": {"launch_decay"},
        "formerly_heldout_scenarios": {"weekly_holiday", "growth_outage", "tenant_waves"},
    }
    for group, names in groups.items():
        assert set(result[group]) == names, group
        for name, s in result[group].items():
            assert set(s) >= POLICIES, name
            # the three policies were run on the same seeded trace
            assert s["planner"]["requests"] == s["queue_blind"]["requests"], name
            assert s["planner"]["requests"] == s["static"]["requests"] > 0, name
            for pol in POLICIES:
                assert _share(s[pol]["attainment"]) and s[pol]["replica_hours"] > 0, (name, pol)
                assert s[pol]["peak_prefill"] >= 1 and s[pol]["peak_decode"] >= 1, (name, pol)
            assert s["static"]["peak_prefill"] == s["static_replicas"]["prefill"], name
            assert math.isfinite(s["planner"]["replica_hours_saving"]), name
    # each headline is the worst of its group's planner figures
    worst = {g: min(s["planner"]["attainment"] for s in result[g].values()) for g in groups}
    assert result["attainment"] == result["attainment_min"] == worst["scenarios"]
    assert result["attainment_heldout"] == worst["heldout_scenarios"]
    assert result["attainment_formerly_heldout"] == worst["formerly_heldout_scenarios"]
    # the P:D split: both ratios measured, the planner's choices made, the curve drawn
    for key in ("disagg_goodput_ratio", "disagg_goodput_ratio_long_outputs"):
        assert isinstance(result[key], float) and 0 < result[key] < math.inf, key
    assert result["disagg_goodput_lengths"]["output"] == 100
    assert result["disagg_goodput_lengths_long_outputs"]["output"] == 500
    ceiling = result["disagg_goodput_fluid_ceiling"]  # analytic: no measurement in it
    assert ceiling > result["disagg_goodput_fluid_ceiling_long_outputs"]
    assert isinstance(result["colocated_chosen_short"], bool)
    assert isinstance(result["planner_disaggregates_long_strict"], bool)
    curve = result["disagg_goodput_curve"]
    assert [r["step_multiple"] for r in curve] == [1.2, 1.6]
    assert curve[0]["fluid_ceiling"] > curve[1]["fluid_ceiling"] > 1.0  # looser: less to gain
    assert curve[1]["tpot_ms"] / curve[0]["tpot_ms"] == pytest.approx(1.6 / 1.2, rel=0.01)
    assert all(r["colocated"] > 0 and r["disagg"] > 0 for r in curve)
    assert result["disagg_goodput_tpot_s"] == 0.012
    assert 1.5 < result["disagg_goodput_tpot_step_multiple"] < 1.7
    assert (tmp_path / "simulate_tpot.png").stat().st_size > 5_000
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    # the bench's own check reads this output: every figure it bounds is here
    assert isinstance(simulate_check.failures(result), list)


def test_the_check_names_each_missed_bound() -> None:
    """``--check`` against a made-up result: a planner worse than queue-blind and a P:D
    ratio of 1 are named; the same result with sound figures passes."""
    planner = {"attainment": 0.95, "replica_hours_saving": 0.3}
    good = {"planner": planner, "queue_blind": {"attainment": 0.9}, "static": {"attainment": 1.0}}
    result = {
        "attainment_min": 0.95,
        "queue_blind_attainment": 0.9,
        "scenarios": {"diurnal": good, "burst": good},
        "formerly_heldout_scenarios": {"weekly_holiday": good, "growth_outage": good},
        "heldout_scenarios": {"launch_decay": good},
        "disagg_goodput_ratio": 2.0,
        "disagg_goodput_ratio_long_outputs": 2.0,
        "colocated_chosen_short": True,
        "planner_disaggregates_long_strict": True,
    }
    assert simulate_check.failures(result) == []
    bad = {**result, "queue_blind_attainment": 0.97, "disagg_goodput_ratio": 1.0}
    missed = simulate_check.failures(bad)
    assert len(missed) == 2, missed
    assert missed[0].startswith("attainment_min > queue_blind_attainment")
    assert missed[1].startswith("disagg_goodput_ratio > 1.3")
