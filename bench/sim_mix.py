"""The P:D split, measured step by step and chosen by the planner (used by simulate.py).

Two loads on the same 4 replicas (H100 / Llama-3-8B profile):
- long prompts (lognormal mean 8000) with a strict TPOT (12 ms, ~1.6x one decode step
  at 8k context) and TTFT 2 s: every mix 0:4 (colocated) .. 3:1 is measured;
  ``disagg_goodput_ratio`` = best disaggregated mix / colocated;
- short prompts (mean 256, outputs 200) with a loose TPOT (100 ms), TTFT 1 s:
  ``colocated_chosen_short`` = the planner's choice (mix.py) is colocation; the
  measurement says whether colocation is also the measured best.
"""

from __future__ import annotations

import numpy as np
from sim_goodput import Link, goodput
from sim_scenarios import _lognormal

from pdserve.planner.config import SLO, PlannerConfig
from pdserve.planner.mix import COLOCATED, choose_mix
from pdserve.planner.presets import H100_LLAMA3_8B

REPLICAS = 4
LINK = Link(131_072, 40e9, 0.001)  # 128 KiB of KV per token, 400 Gb/s at 80%


def _case(name: str, lengths: tuple, slo: SLO, hi: float, quick: bool) -> dict:
    duration, iters = (20.0, 5) if quick else (60.0, 9)
    measured = {}
    for p in range(REPLICAS):
        mix = (p, REPLICAS - p)
        rate = goodput(
            H100_LLAMA3_8B, mix, lengths, (slo.ttft_s, slo.tpot_s), LINK, duration, hi, iters
        )
        measured[f"{p}:{REPLICAS - p}"] = round(rate / REPLICAS, 3)  # per replica
    colocated = measured[f"0:{REPLICAS}"]
    best_mix = max((k for k in measured if not k.startswith("0:")), key=measured.__getitem__)
    cfg = PlannerConfig(slo=slo, profile=H100_LLAMA3_8B)
    choice = choose_mix(cfg, float(lengths[0].mean()), float(lengths[1].mean()))
    return {
        "name": name,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput_per_replica": measured,
        "best_disagg_mix": best_mix,
        "ratio": round(measured[best_mix] / colocated, 3) if colocated > 0 else float("inf"),
        "measured_best": "colocated" if colocated >= measured[best_mix] else best_mix,
        "planner_mode": choice.mode,
        "planner_prefill_share": round(choice.prefill_share, 3),
        "planner_reason": choice.reason,
    }


def mix_section(quick: bool) -> dict:
    rng = np.random.default_rng(5)
    out = _lognormal(rng, 20_000, 500, 0.7, 2, 2048)
    long = (_lognormal(rng, 20_000, 8000, 0.4, 2048, 16384), out)
    short = (
        _lognormal(rng, 20_000, 256, 0.6, 16, 2048),
        _lognormal(rng, 20_000, 200, 0.7, 2, 1024),
    )
    strict = _case("long_prompts_strict_tpot", long, SLO(2.0, 0.012), 8.0, quick)
    loose = _case("short_prompts_loose_tpot", short, SLO(1.0, 0.1), 400.0, quick)
    return {
        "disagg_goodput_ratio": strict["ratio"],
        "colocated_chosen_short": loose["planner_mode"] == COLOCATED,
        "colocated_measured_best_short": loose["measured_best"] == "colocated",
        "planner_disaggregates_long_strict": strict["planner_mode"] != COLOCATED,
        "cases": [strict, loose],
    }
