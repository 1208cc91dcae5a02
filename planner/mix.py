"""The prefill:decode split as a decision: a P:D mix, or colocation (no prefill pool).

For a load (mean prompt ``L``, mean output ``O``) and the SLOs, the planner compares
goodput per replica (DistServe's measure: requests/s served inside both SLOs) of

- **disaggregated**: a prefill replica serves ``r_P = mu * rho* / L`` (the TTFT model of
  ``model.py``); a decode replica ``r_D = B* / (O * step(B*, C))`` with ``C = L + O/2``.
  The best mix gives prefill the share ``r_D / (r_P + r_D)`` of the replicas, and
  ``g_dis = r_P * r_D / (r_P + r_D)`` per replica;
- **colocated** (decode workers prefill locally, the router's conditional
  disaggregation): a replica at ``r`` req/s spends ``rho_p = r * w(L)`` of its time on
  prefill chunks (``w`` = token + attention cost), which stretches every decode step:
  ``TPOT = step(B, C) / (1 - rho_p)``; a short request (``O/3`` tokens) also absorbs
  one whole chunk; TTFT is the prompt's chunks (each with a decode step) over
  ``1 - rho_p``. ``g_col`` = the largest ``r`` meeting both SLOs (bisection).

Colocation is chosen when ``g_col >= g_dis``: short prompts with a loose TPOT. Long
prompts with a strict TPOT cannot absorb a prefill chunk in a decode step, and
disaggregation wins (bench/simulate.py measures both step by step: planner/sim/goodput.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.planner.config import PlannerConfig

DISAGGREGATED = "disaggregated"
COLOCATED = "colocated"
SHORT_OUTPUT_SHARE = 1 / 3  # a 10th-percentile output, relative to the mean (lognormal)


@dataclass(frozen=True)
class MixChoice:
    mode: str  # DISAGGREGATED | COLOCATED
    prefill_share: float  # of the replicas, in the prefill pool (0 when colocated)
    disagg_goodput: float  # req/s per replica, best P:D mix
    colocated_goodput: float  # req/s per replica
    reason: str

    @property
    def goodput(self) -> float:
        return self.colocated_goodput if self.mode == COLOCATED else self.disagg_goodput


def disagg_rates(cfg: PlannerConfig, prompt: float, output: float) -> tuple[float, float]:
    """(r_P, r_D): requests/s of one prefill replica and one decode replica at the SLOs."""
    p, d = cfg.profile.prefill, cfg.profile.decode
    service = p.service_time(prompt)
    rho = 1.0 - service / cfg.ttft_budget_s
    rho = min(cfg.max_prefill_utilisation, max(0.0, rho))
    r_p = p.saturated_tokens_per_s(prompt) * rho / prompt
    ctx = prompt + output / 2
    batch = d.max_batch_at(cfg.tpot_budget_s, ctx) * cfg.decode_batch_utilisation
    batch = min(batch, cfg.kv_target_utilisation * d.kv_capacity_tokens / ctx)
    step = d.step_time(batch, ctx)
    r_d = batch / (output * step) if step <= cfg.tpot_budget_s else 0.0
    return r_p, r_d


def colocated_ok(cfg: PlannerConfig, rate: float, prompt: float, output: float) -> bool:
    """Does one colocated replica meet both SLOs at ``rate`` req/s?"""
    p, d = cfg.profile.prefill, cfg.profile.decode
    work = prompt / p.tokens_per_s + p.attention_s_per_token_sq * prompt**2
    rho = rate * work
    if rho >= cfg.max_prefill_utilisation:
        return False
    ctx = prompt + output / 2
    tpot, batch = d.step_time(1, ctx), 1.0
    for _ in range(20):  # fixed point: the batch depends on how long sequences stay
        batch = max(1.0, rate * output * tpot)
        tpot = d.step_time(batch, ctx) / (1 - rho)
    chunk = min(prompt, p.chunk_tokens)
    stall = chunk / p.tokens_per_s + p.attention_s_per_token_sq * chunk**2
    short = max(1.0, output * SHORT_OUTPUT_SHARE)
    fits = batch <= d.max_num_seqs * cfg.decode_batch_utilisation
    fits = fits and batch * ctx <= cfg.kv_target_utilisation * d.kv_capacity_tokens
    tpot_ok = tpot + stall / short <= cfg.tpot_budget_s
    ttft = (work + math.ceil(prompt / p.chunk_tokens) * d.step_time(batch, ctx)) / (1 - rho)
    return fits and tpot_ok and ttft <= cfg.ttft_budget_s


def colocated_goodput(cfg: PlannerConfig, prompt: float, output: float) -> float:
    lo, hi = 0.0, 1.0
    while colocated_ok(cfg, hi, prompt, output) and hi < 1e6:
        lo, hi = hi, hi * 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if colocated_ok(cfg, mid, prompt, output) else (lo, mid)
    return lo


def choose_mix(cfg: PlannerConfig, prompt: float, output: float, rate: float = 0.0) -> MixChoice:
    """``rate`` > 0: compare whole replicas at that rate (a prefill pool is at least one
    replica, which is what makes colocation pay for small services)."""
    r_p, r_d = disagg_rates(cfg, prompt, output)
    g_dis = r_p * r_d / (r_p + r_d) if r_p > 0 and r_d > 0 else 0.0
    share = r_d / (r_p + r_d) if r_p + r_d > 0 else 0.5
    g_col = colocated_goodput(cfg, prompt, output)
    if rate > 0 and g_dis > 0 and g_col > 0:
        g_dis = rate / (math.ceil(rate / r_p) + math.ceil(rate / r_d))
        g_col = rate / math.ceil(rate / g_col)
    load = f"prompt {prompt:.0f}, output {output:.0f} tokens"
    if g_col >= g_dis:
        why = (
            f"colocated: {g_col:.2f} req/s per replica vs {g_dis:.2f} disaggregated ({load}): "
            "decode workers prefill locally"
        )
        return MixChoice(COLOCATED, 0.0, g_dis, g_col, why)
    why = (
        f"disaggregated P:D {share:.2f}:{1 - share:.2f}: {g_dis:.2f} req/s per replica vs "
        f"{g_col:.2f} colocated ({load})"
    )
    return MixChoice(DISAGGREGATED, share, g_dis, g_col, why)


SWITCH_MARGIN = 0.05  # the other mode must be this much better to switch (no flapping)


def decide_mode(
    cfg: PlannerConfig, prompt: float, output: float, current: str, rate: float = 0.0
) -> tuple[MixChoice, str, str]:
    """(the comparison, the mode to run, why). Colocation needs a prefill pool that may be
    empty (``prefill.min_replicas == 0``); a switch needs a clear win."""
    choice = choose_mix(cfg, prompt, output, rate)
    mode, why = choice.mode, choice.reason
    if cfg.prefill.max_replicas == 0:
        return choice, COLOCATED, "colocated: no prefill pool allowed (prefill maxReplicas 0)"
    if mode == COLOCATED and cfg.prefill.min_replicas > 0:
        return choice, DISAGGREGATED, why + "; not applied: prefill minReplicas > 0"
    if mode != current and current in (COLOCATED, DISAGGREGATED):
        best, other = (
            max(choice.colocated_goodput, choice.disagg_goodput),
            min(choice.colocated_goodput, choice.disagg_goodput),
        )
        if best < other * (1 + SWITCH_MARGIN):
            return choice, current, why + f"; staying {current} (within {SWITCH_MARGIN:.0%})"
    return choice, mode, why
