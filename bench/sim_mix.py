"""The P:D split, measured step by step and chosen by the planner (used by simulate.py).

Loads on the same 8 replicas (H100 / Llama-3-8B profile):
- long prompts (lognormal mean 8000) with a strict TPOT and TTFT 2 s, two output shapes:
  short outputs (mean 100: summarisation, the shape DistServe reports its gains on), the
  headline ``disagg_goodput_ratio``, mixes 3:5 .. 7:1; and long outputs (mean 500: chat
  over a long document), ``disagg_goodput_ratio_long_outputs``, mixes 1:7 .. 4:4. Each
  ratio = best disaggregated mix / colocated (0:8), colocation at its best token budget
  per step (sim_mix_sweep.CHUNKS). The TPOT is 12 ms: 1.6x one decode step at the mean
  context (7.4 ms), where the TPOT, not the KV memory, limits a decode replica's batch
  (to ~11 such sequences where its memory holds ~48): strict. ``disagg_goodput_curve``
  (and ``..._long_outputs``) is the same ratio at TPOT targets from 1.1x to 2.5x one step
  (sim_mix_sweep.py), beside the fluid ceiling: with chunked prefill, long outputs cap
  the gain at 1.66 at 12 ms (a colocated replica pays the prompts' prefill time out of
  its decode slack, and 500 decode steps dilute it), short outputs at 2.17 on the mean,
  and more in the tail (100 tokens absorb a 0.45 s chunk stall badly);
- short prompts (mean 256, outputs 200) with a loose TPOT (100 ms), TTFT 1 s:
  ``colocated_chosen_short`` = the planner's choice (mix.py) is colocation; the
  measurement says whether colocation is also the measured best.

Each goodput is a bisection over the rate on one seed's arrivals; one seed of 60 s
(~150 requests counted at the goodput rate) moved the ratio by +-0.5 between runs, so
the full run measures 240 s per point (short prompts: 30 s, ~10k requests) on 3 seeds and
reports the ratio per seed and its minimum; the curve is one seed of 120 s per point
(``--quick``: one seed of 15 s, short prompts 2 s, the headline curve at two TPOTs over
10 s: a smoke test of the path, not a figure).
"""

from __future__ import annotations

import numpy as np
from sim_mix_sweep import (
    CHUNKS,
    PREFILL_COUNTS,
    PROFILE,
    REPLICAS,
    SHORT_OUTPUT_PREFILL_COUNTS,
    colocated_best,
    decode_step,
    fluid_ceiling,
    per_replica,
    tpot_sweep,
)

from pdserve.planner.config import SLO, PlannerConfig
from pdserve.planner.mix import COLOCATED, choose_mix
from pdserve.planner.sim.scenarios import _lognormal

__all__ = ["fluid_ceiling", "mix_section"]
SEEDS_FULL = (0, 1, 2)
HEADLINE_TPOT_S = 0.012


def _case(
    name: str,
    lengths: tuple,
    slo: SLO,
    hi: float,
    quick: bool,
    full_s: float,
    chunks: tuple[int, ...],
    counts: tuple[int, ...] = PREFILL_COUNTS,
) -> dict:
    run = (full_s / 16, 5, (0,), hi) if quick else (full_s, 9, SEEDS_FULL, hi)
    chunk, colocated, per_chunk = colocated_best(lengths, slo, run, chunks)
    per_seed = {f"0:{REPLICAS}": colocated}
    for p in counts:
        per_seed[f"{p}:{REPLICAS - p}"] = per_replica(PROFILE, (p, REPLICAS - p), lengths, slo, run)
    measured = {k: round(float(np.mean(v)), 3) for k, v in per_seed.items()}  # per replica
    best_mix = max((k for k in measured if not k.startswith("0:")), key=measured.__getitem__)
    ratios = [
        b / c if c > 0 else float("inf") for b, c in zip(per_seed[best_mix], colocated, strict=True)
    ]
    cfg = PlannerConfig(slo=slo, profile=PROFILE)
    choice = choose_mix(cfg, float(lengths[0].mean()), float(lengths[1].mean()))
    return {
        "name": name,
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "goodput_per_replica": measured,
        "goodput_per_replica_per_seed": {k: [round(x, 3) for x in v] for k, v in per_seed.items()},
        "colocated_chunk": chunk,  # the token budget colocation was measured at (its best)
        "colocated_per_chunk": per_chunk,
        "best_disagg_mix": best_mix,
        "ratio": round(min(ratios), 3),  # the worst seed
        "ratio_per_seed": [round(r, 3) for r in ratios],
        "seconds_per_point": run[0],
        "measured_best": "colocated"
        if measured[f"0:{REPLICAS}"] >= measured[best_mix]
        else best_mix,
        "planner_mode": choice.mode,
        "planner_prefill_share": round(choice.prefill_share, 3),
        "planner_reason": choice.reason,
    }


def mix_section(quick: bool) -> dict:
    rng = np.random.default_rng(5)
    out = _lognormal(rng, 20_000, 500, 0.7, 2, 2048)
    long_prompts = _lognormal(rng, 20_000, 8000, 0.4, 2048, 16384)
    long_out = (long_prompts, out)
    short = (
        _lognormal(rng, 20_000, 256, 0.6, 16, 2048),
        _lognormal(rng, 20_000, 200, 0.7, 2, 1024),
    )
    summary = (long_prompts, _lognormal(rng, 20_000, 100, 0.7, 2, 1024))
    # 240 s: ~1,000 long-prompt requests per point at the goodput rate; 30 s of short
    # prompts is already ~10k requests per point
    chunks = (8192,) if quick else CHUNKS
    slo = SLO(2.0, HEADLINE_TPOT_S)
    strict = _case(
        "long_prompts_short_outputs_strict_tpot",
        summary,
        slo,
        24.0,
        quick,
        240.0,
        chunks,
        SHORT_OUTPUT_PREFILL_COUNTS,
    )
    long = _case("long_prompts_long_outputs_strict_tpot", long_out, slo, 16.0, quick, 240.0, chunks)
    loose = _case(
        "short_prompts_loose_tpot",
        short,
        SLO(1.0, 0.1),
        800.0,
        quick,
        30.0,
        (PROFILE.prefill.chunk_tokens,),
    )
    # the curve tries every mix: at 1.1-1.2x one step the decode pool needs most replicas
    curve = tpot_sweep(summary, 2.0, quick, tuple(range(1, REPLICAS)))
    curve_long = [] if quick else tpot_sweep(long_out, 2.0, quick)
    return {
        "disagg_goodput_ratio": strict["ratio"],
        "disagg_goodput_tpot_s": HEADLINE_TPOT_S,
        "disagg_goodput_tpot_step_multiple": round(
            HEADLINE_TPOT_S / decode_step(PROFILE, summary)[0], 2
        ),
        "disagg_goodput_lengths": _means(summary),
        "disagg_goodput_fluid_ceiling": _ceiling(summary),
        "disagg_goodput_ratio_per_seed": strict["ratio_per_seed"],
        "disagg_goodput_best_mix": strict["best_disagg_mix"],
        "disagg_goodput_colocated_chunk": strict["colocated_chunk"],
        "disagg_goodput_curve": curve,  # per TPOT target: measured ratio, fluid ceiling
        "disagg_goodput_curve_max": max((r["ratio"] or 0.0) for r in curve),
        "disagg_goodput_ratio_long_outputs": long["ratio"],
        "disagg_goodput_lengths_long_outputs": _means(long_out),
        "disagg_goodput_fluid_ceiling_long_outputs": _ceiling(long_out),
        "disagg_goodput_ratio_per_seed_long_outputs": long["ratio_per_seed"],
        "disagg_goodput_curve_long_outputs": curve_long,
        "colocated_chosen_short": loose["planner_mode"] == COLOCATED,
        "colocated_measured_best_short": loose["measured_best"] == "colocated",
        "planner_disaggregates_long_strict": strict["planner_mode"] != COLOCATED
        and long["planner_mode"] != COLOCATED,
        "cases": [strict, long, loose],
    }


def _means(lengths: tuple) -> dict[str, float]:
    return {"prompt": round(float(lengths[0].mean())), "output": round(float(lengths[1].mean()))}


def _ceiling(lengths: tuple) -> float:
    mean = (float(lengths[0].mean()), float(lengths[1].mean()))
    return round(fluid_ceiling(PROFILE, *mean, HEADLINE_TPOT_S), 3)
