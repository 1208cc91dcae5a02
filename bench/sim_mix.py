"""The P:D split, measured step by step and chosen by the planner (used by simulate.py).

Two loads on the same 4 replicas (H100 / Llama-3-8B profile):
- long prompts (lognormal mean 8000) with a strict TPOT (12 ms, ~1.6x one decode step
  at 8k context) and TTFT 2 s: every mix 0:4 (colocated) .. 3:1 is measured;
  ``disagg_goodput_ratio`` = best disaggregated mix / colocated;
- short prompts (mean 256, outputs 200) with a loose TPOT (100 ms), TTFT 1 s:
  ``colocated_chosen_short`` = the planner's choice (mix.py) is colocation; the
  measurement says whether colocation is also the measured best.

Each goodput is a bisection over the rate on one seed's arrivals; one seed of 60 s
(~150 requests counted at the goodput rate) moved the ratio by +-0.5 between runs, so
the full run measures 240 s per point (short prompts: 60 s, ~10k requests) on 3 seeds and
reports the ratio per seed and its minimum (``--quick``: one seed of 20 s, a smoke test
of the path, not a figure).
"""

from __future__ import annotations

import numpy as np
from sim_goodput import Link, goodput
from sim_scenarios import _lognormal

from pdserve.planner.capacity import Profile
from pdserve.planner.config import SLO, PlannerConfig
from pdserve.planner.mix import COLOCATED, choose_mix
from pdserve.planner.presets import H100_LLAMA3_8B

REPLICAS = 4
LINK = Link(131_072, 40e9, 0.001)  # 128 KiB of KV per token, 400 Gb/s at 80%


SEEDS_FULL = (0, 1, 2)


def _case(name: str, lengths: tuple, slo: SLO, hi: float, quick: bool, full_s: float) -> dict:
    duration, iters, seeds = (20.0, 5, (0,)) if quick else (full_s, 8, SEEDS_FULL)
    per_seed: dict[str, list[float]] = {}
    for p in range(REPLICAS):
        mix = (p, REPLICAS - p)
        per_seed[f"{p}:{REPLICAS - p}"] = [
            goodput(H100_LLAMA3_8B, mix, lengths, (slo.ttft_s, slo.tpot_s), LINK, duration, hi,
                    iters, seed) / REPLICAS
            for seed in seeds
        ]  # fmt: skip
    measured = {k: round(float(np.mean(v)), 3) for k, v in per_seed.items()}  # per replica
    colocated = measured[f"0:{REPLICAS}"]
    best_mix = max((k for k in measured if not k.startswith("0:")), key=measured.__getitem__)
    ratios = [
        b / c if c > 0 else float("inf")
        for b, c in zip(per_seed[best_mix], per_seed[f"0:{REPLICAS}"], strict=True)
    ]
    cfg = PlannerConfig(slo=slo, profile=H100_LLAMA3_8B)
    choice = choose_mix(cfg, float(lengths[0].mean()), float(lengths[1].mean()))
    return {
        "name": name,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput_per_replica": measured,
        "goodput_per_replica_per_seed": {k: [round(x, 3) for x in v] for k, v in per_seed.items()},
        "best_disagg_mix": best_mix,
        "ratio": round(min(ratios), 3),  # the worst seed
        "ratio_per_seed": [round(r, 3) for r in ratios],
        "seconds_per_point": duration,
        "measured_best": "colocated" if colocated >= measured[best_mix] else best_mix,
        "planner_mode": choice.mode,
        "planner_prefill_share": round(choice.prefill_share, 3),
        "planner_reason": choice.reason,
    }


def fluid_ceiling(prof: Profile, prompt: float, output: float, tpot_s: float) -> float:
    """Best continuous P:D mix over colocation, from mean rates (docs/autoscaling.md).

    A decode step at context ``C = prompt + output / 2`` costs ``a + b B``; a decode
    replica alone runs ``B = (T - a) / b`` sequences at the TPOT target ``T``; a colocated
    replica at ``r`` req/s spends ``r p`` of its time prefilling (``p``: one prompt), so
    its TPOT is ``(a + b B) / (1 - r p)``. With ``x = T / (T - a)`` the ratio is
    ``(p + b O) x / (p + b O x)``: at most ``x``, reached when prefill dominates. Chunked
    prefill costs a colocated replica the prompts' prefill time and nothing more, which
    is what bounds it; the step simulator's tail (90% within the SLO) moves it a little."""
    d = prof.decode
    ctx = prompt + output / 2
    b = d.step_time(2, ctx) - d.step_time(1, ctx)
    a = d.step_time(1, ctx) - b
    if tpot_s <= a or b <= 0:
        return float("inf")  # no decode batch meets the TPOT: colocation serves nothing
    p, x = prof.prefill.service_time(prompt), tpot_s / (tpot_s - a)
    return (p + b * output) * x / (p + b * output * x)


def mix_section(quick: bool) -> dict:
    rng = np.random.default_rng(5)
    out = _lognormal(rng, 20_000, 500, 0.7, 2, 2048)
    long = (_lognormal(rng, 20_000, 8000, 0.4, 2048, 16384), out)
    short = (
        _lognormal(rng, 20_000, 256, 0.6, 16, 2048),
        _lognormal(rng, 20_000, 200, 0.7, 2, 1024),
    )
    # 240 s: ~600 long-prompt requests per point at the goodput rate; 60 s of short
    # prompts is already ~10k requests per point
    strict = _case("long_prompts_strict_tpot", long, SLO(2.0, 0.012), 8.0, quick, 240.0)
    loose = _case("short_prompts_loose_tpot", short, SLO(1.0, 0.1), 400.0, quick, 60.0)
    ceiling = fluid_ceiling(H100_LLAMA3_8B, float(long[0].mean()), float(long[1].mean()), 0.012)
    return {
        "disagg_goodput_ratio": strict["ratio"],
        "disagg_goodput_fluid_ceiling": round(ceiling, 3),  # what this scenario allows
        "disagg_goodput_ratio_per_seed": strict["ratio_per_seed"],
        "colocated_chosen_short": loose["planner_mode"] == COLOCATED,
        "colocated_measured_best_short": loose["measured_best"] == "colocated",
        "planner_disaggregates_long_strict": strict["planner_mode"] != COLOCATED,
        "cases": [strict, loose],
    }
