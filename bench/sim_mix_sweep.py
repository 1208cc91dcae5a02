"""How much the P:D split gains, as a function of how strict the TPOT is (sim_mix.py).

The gain of the best disaggregated mix over colocation depends on how close the TPOT
target ``T`` is to one decode step: a colocated replica pays the prompts' prefill time
out of its decode steps' slack ``T - a`` (``a``: a decode step's fixed cost), so the
fluid ceiling is ``x = T / (T - a)`` at most (``fluid_ceiling``). One figure at one TPOT
says little; ``tpot_sweep`` measures the ratio step by step (planner/sim/goodput.py) at TPOT
targets from 1.1x to 2.5x one decode step at the scenario's mean context, next to the
fluid ceiling at each.

Colocation is given its best engine configuration: its token budget per step
(``max_num_batched_tokens``, the chunk a prompt is prefilled in beside the decodes) is
the best of ``CHUNKS``, per TPOT, as one would configure a colocated engine for a
strict TPOT (Sarathi-Serve's lever); the disaggregated prefill pool keeps the profile's
8192-token steps (a prefill-only replica has no decodes to stall).
"""

from __future__ import annotations

from dataclasses import replace

import figures
import numpy as np

from pdserve.planner.capacity import Profile
from pdserve.planner.config import SLO
from pdserve.planner.presets import H100_LLAMA3_8B
from pdserve.planner.sim.goodput import Link, goodput

PROFILE = H100_LLAMA3_8B
# 8 replicas: the best mix is a prefill share of ~30-50% here, which 4 replicas can only
# round to 25% or 50% (at 1.35x one step, seed 0: 4 replicas 1.40, 8 replicas 2.09)
REPLICAS = 8
# the mixes tried: long outputs (500) 1:7 .. 4:4 (more prefill never won); short
# outputs (100) 3:5 .. 7:1 (decode is a fifth of the work: 2:6 never won)
PREFILL_COUNTS = (1, 2, 3, 4)
SHORT_OUTPUT_PREFILL_COUNTS = (3, 4, 5, 6, 7)
LINK = Link(131_072, 40e9, 0.001)  # 128 KiB of KV per token, 400 Gb/s at 80%
CHUNKS = (512, 2048, 8192)  # colocated token budgets tried (the headline)
CURVE_CHUNKS = (2048, 8192)  # (the curve: 512 never beat both of these)
TPOT_MULTIPLES = (1.1, 1.2, 1.35, 1.6, 2.0, 2.5)  # of one decode step at the mean context

Lengths = tuple[np.ndarray, np.ndarray]


def per_replica(
    prof: Profile, mix: tuple[int, int], lengths: Lengths, slo: SLO, run: tuple
) -> list[float]:
    """Goodput per replica of ``mix`` on each seed; ``run`` = (seconds, bisection steps,
    seeds, highest rate tried for the whole mix)."""
    duration, iters, seeds, hi = run
    n = sum(mix)
    slos = (slo.ttft_s, slo.tpot_s)
    return [goodput(prof, mix, lengths, slos, LINK, duration, hi, iters, s) / n for s in seeds]


def with_chunk(prof: Profile, chunk: int) -> Profile:
    return replace(prof, prefill=replace(prof.prefill, chunk_tokens=chunk))


def colocated_best(
    lengths: Lengths, slo: SLO, run: tuple, chunks: tuple[int, ...]
) -> tuple[int, list[float], dict[str, float]]:
    """(the best token budget by mean goodput, its goodput per seed, mean per budget)."""
    per_chunk = {
        c: per_replica(with_chunk(PROFILE, c), (0, REPLICAS), lengths, slo, run) for c in chunks
    }
    best = max(chunks, key=lambda c: float(np.mean(per_chunk[c])))
    means = {str(c): round(float(np.mean(v)), 3) for c, v in per_chunk.items()}
    return best, per_chunk[best], means


def decode_step(prof: Profile, lengths: Lengths) -> tuple[float, float, float]:
    """(one decode step alone, its fixed cost a, per sequence b) at the mean context."""
    return _step_costs(prof, float(lengths[0].mean() + lengths[1].mean() / 2))


def _step_costs(prof: Profile, ctx: float) -> tuple[float, float, float]:
    """(one decode step alone, a, b) at context ``ctx``: a step of B sequences is a + b B."""
    one = prof.decode.step_time(1, ctx)
    b = prof.decode.step_time(2, ctx) - one
    return one, one - b, b


def fluid_ceiling(prof: Profile, prompt: float, output: float, tpot_s: float) -> float:
    """Best continuous P:D mix over colocation, from mean rates (docs/autoscaling.md).

    A decode step at context ``C = prompt + output / 2`` costs ``a + b B``; a decode
    replica alone runs ``B = (T - a) / b`` sequences at the TPOT target ``T``; a colocated
    replica at ``r`` req/s spends ``r p`` of its time prefilling (``p``: one prompt), so
    its TPOT is ``(a + b B) / (1 - r p)``. With ``x = T / (T - a)`` the ratio is
    ``(p + b O) x / (p + b O x)``: at most ``x``, reached when prefill dominates. Chunked
    prefill costs a colocated replica the prompts' prefill time and nothing more, which
    is what bounds it; the step simulator's tail (90% within the SLO) moves it a little."""
    _, a, b = _step_costs(prof, prompt + output / 2)
    if tpot_s <= a or b <= 0:
        return float("inf")  # no decode batch meets the TPOT: colocation serves nothing
    p, x = prof.prefill.service_time(prompt), tpot_s / (tpot_s - a)
    return (p + b * output) * x / (p + b * output * x)


def tpot_sweep(
    lengths: Lengths, ttft_s: float, quick: bool, counts: tuple[int, ...] = PREFILL_COUNTS
) -> list[dict]:
    """The measured ratio (best mix / colocation at its best budget) per TPOT target,
    over the mixes ``p:(REPLICAS - p)`` for ``p`` in ``counts``."""
    multiples, run, chunks = (
        ((1.2, 1.6), (10.0, 5, (0,), 16.0), (2048,))
        if quick
        else (TPOT_MULTIPLES, (120.0, 9, (0,), 16.0), CURVE_CHUNKS)
    )
    step, a, b = decode_step(PROFILE, lengths)
    rows = []
    for m in multiples:
        slo = SLO(ttft_s, m * step)
        chunk, col, col_chunks = colocated_best(lengths, slo, run, chunks)
        dis = {
            f"{p}:{REPLICAS - p}": per_replica(PROFILE, (p, REPLICAS - p), lengths, slo, run)[0]
            for p in counts
        }
        best = max(dis, key=dis.__getitem__)
        ceiling = fluid_ceiling(
            PROFILE, float(lengths[0].mean()), float(lengths[1].mean()), slo.tpot_s
        )
        rows.append(
            {
                "tpot_ms": round(slo.tpot_s * 1e3, 2),
                "step_multiple": m,
                "decode_batch_at_tpot": round((slo.tpot_s - a) / b, 1),  # B = (T - a) / b
                "ratio": round(dis[best] / col[0], 3) if col[0] > 0 else None,
                "fluid_ceiling": round(ceiling, 3),
                "best_mix": best,
                "disagg": round(dis[best], 3),
                "colocated": round(col[0], 3),
                "colocated_chunk": chunk,
                "colocated_per_chunk": col_chunks,
            }
        )
    return rows


def plot_curve(curves: dict[str, list[dict]], headline: float, path: str) -> str:
    """Per workload (label -> curve): the measured ratio and the fluid ceiling against
    the TPOT target (a PNG)."""
    plt = figures.pyplot()

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, (label, curve) in enumerate(curves.items()):
        m = [r["step_multiple"] for r in curve]
        ax.plot(
            m,
            [r["ratio"] or 0.0 for r in curve],
            "o-",
            color=f"C{k}",
            label=f"{label}: measured (step simulator)",
        )
        ax.plot(
            m,
            [min(r["fluid_ceiling"], 5.0) for r in curve],
            "s--",
            color=f"C{k}",
            alpha=0.5,
            label=f"{label}: fluid ceiling",
        )
    ax.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax.axvline(headline, color="C3", lw=0.8, ls=":", label="headline TPOT (12 ms)")
    ax.set(
        xlabel="TPOT target / one decode step at 8k context",
        ylabel="best P:D mix / colocated goodput",
        title=f"long prompts (8k), {REPLICAS} replicas, H100 profile",
    )
    ax.legend(fontsize=7)
    figures.save(fig, path, dpi=90)
    return path
