"""The load model: how many replicas each pool needs for this interval's load.

Prefill (per replica, prompt tokens per second, corrected by ``c_p``)::

    S    = c_p * prefill_time(L)                  mean service time of one prompt
    mu   = saturated_tokens_per_s(L) / c_p        busy-replica throughput
    rho* = clamp(1 - S / (h_ttft * TTFT), rho_min, rho_max)
           (the utilisation at which the M/M/1 mean response S / (1 - rho) is h_ttft * TTFT)
    backlog = max(queue_depth * L, queue_wait * ready * mu)   [queue-wait term]
    need_prefill = (prompt_rate * (1 - cached) * g + backlog / drain_s) / (mu * rho*)
    (g: forecast growth; the planner itself sizes for the moment new pods are
    ready, in ``ahead.py``; this form is the steady-state sizing used by tools)

Decode (per replica, corrected by ``c_d``; C = mean context)::

    B*   = u_batch * (max batch with step_time(B, C) <= h_tpot * TPOT / c_d)
    need_decode = g * max((running + waiting + prefill_queue_depth) / B*,
                      output_rate / (B* / (c_d * step_time(B*, C))),
                      (running + waiting + prefill_queue_depth) * C / (kv_target * kv_capacity))
    (the prefill queue counts here because it reaches decode as soon as it drains;
    without the queue terms, the steady need, which is all the window remembers)

Corrections are EWMAs of observed / predicted latency (prefill: TTFT minus queue
wait vs ``prefill_time(L)``; decode: TPOT vs ``step_time``), updated only when the
pool is not overloaded (a growing queue is the backlog term's job, not the model's).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.config import PlannerConfig
from pdserve.planner.snapshot import MetricsSnapshot

FALLBACK_PROMPT_TOKENS = 512.0  # used only when no request arrived this interval
FALLBACK_OUTPUT_TOKENS = 128.0


@dataclass(frozen=True)
class PrefillNeed:
    need: float
    steady_need: float  # without the backlog term
    capacity_per_replica: float  # prompt tokens/s at the TTFT SLO
    target_utilisation: float
    demand_tokens_per_s: float
    backlog_tokens: float
    correction: float


@dataclass(frozen=True)
class DecodeNeed:
    need: float
    steady_need: float  # without the sequences waiting for a slot
    batch_per_replica: float  # B* at the TPOT SLO
    tokens_per_replica: float
    mean_context: float
    by_sequences: float
    by_tokens: float
    by_kv: float
    correction: float


def prefill_rates(
    snap: MetricsSnapshot, cfg: PlannerConfig, correction: float
) -> tuple[float, float, float]:
    """(mean uncached prompt L, saturated tokens/s mu, target utilisation rho*) of one replica."""
    prof = cfg.profile.prefill
    mean_prompt = snap.mean_prompt_tokens * (1.0 - snap.cached_token_fraction)
    if mean_prompt <= 0:
        mean_prompt = FALLBACK_PROMPT_TOKENS
    service = correction * prof.service_time(mean_prompt)
    mu = prof.saturated_tokens_per_s(mean_prompt) / correction
    rho = 1.0 - service / cfg.ttft_budget_s
    rho = min(cfg.max_prefill_utilisation, max(cfg.min_prefill_utilisation, rho))
    return mean_prompt, mu, rho


def prefill_need(
    snap: MetricsSnapshot, cfg: PlannerConfig, correction: float, grow: float = 1.0
) -> PrefillNeed:
    mean_prompt, mu, rho = prefill_rates(snap, cfg, correction)
    demand = snap.prompt_token_rate * (1.0 - snap.cached_token_fraction)
    backlog = 0.0
    if cfg.queue_aware:
        by_depth = snap.prefill_queue_depth * mean_prompt
        by_wait = snap.prefill_queue_wait_s * snap.prefill.ready * mu
        backlog = max(by_depth, by_wait)
    capacity = mu * rho
    need = (demand * grow + backlog / cfg.queue_drain_s) / capacity
    return PrefillNeed(need, demand / capacity, capacity, rho, demand, backlog, correction)


def decode_need(
    snap: MetricsSnapshot,
    cfg: PlannerConfig,
    correction: float,
    grow: float = 1.0,
    queued_requests: float | None = None,
    output_rate: float | None = None,
) -> DecodeNeed:
    """``queued_requests``: prefill queue that reaches decode soon (default: the depth now);
    ``output_rate``: output tokens/s to plan for (default: generated now x ``grow``)."""
    prof = cfg.profile.decode
    context = mean_context(snap, cfg)
    budget = cfg.tpot_budget_s / correction
    batch = prof.max_batch_at(budget, context) * cfg.decode_batch_utilisation
    tokens = batch / (correction * prof.step_time(batch, context))
    kv_per_replica = cfg.kv_target_utilisation * prof.kv_capacity_tokens
    seqs = snap.decode_running + snap.decode_waiting
    running = snap.decode_running * grow
    seqs = running + snap.decode_waiting
    if cfg.queue_aware:  # requests queued for prefill reach decode within the drain horizon
        seqs += snap.prefill_queue_depth if queued_requests is None else queued_requests
    by_seqs = seqs / batch
    out = snap.output_token_rate * grow if output_rate is None else output_rate
    by_tokens = out / tokens
    by_kv = seqs * context / kv_per_replica
    need = max(by_seqs, by_tokens, by_kv)
    steady = max(by_tokens, running * max(1 / batch, context / kv_per_replica))
    return DecodeNeed(need, steady, batch, tokens, context, by_seqs, by_tokens, by_kv, correction)


def mean_context(snap: MetricsSnapshot, cfg: PlannerConfig) -> float:
    """Mean tokens of context per decoding sequence: measured from KV use when possible."""
    kv_total = snap.decode.ready * cfg.profile.decode.kv_capacity_tokens
    if snap.decode_running > 0 and snap.kv_utilisation > 0 and kv_total > 0:
        return snap.kv_utilisation * kv_total / snap.decode_running
    prompt = snap.mean_prompt_tokens or FALLBACK_PROMPT_TOKENS
    output = snap.mean_output_tokens or FALLBACK_OUTPUT_TOKENS
    return prompt + output / 2.0


def update_corrections(
    snap: MetricsSnapshot,
    cfg: PlannerConfig,
    prefill_c: float,
    decode_c: float,
    previous: tuple[float, int] | None = None,
) -> tuple[float, float]:
    """New (prefill, decode) corrections from this interval's observed vs predicted latency.
    ``previous``: (prefill queue depth, ready prefill replicas) at the last interval's end."""
    lo, hi = cfg.correction_bounds
    a = cfg.correction_alpha
    ratio = _prefill_ratio(snap, cfg, previous)
    if ratio is not None:
        prefill_c = min(hi, max(lo, (1 - a) * prefill_c + a * ratio))
    ratio = _decode_ratio(snap, cfg)
    if ratio is not None:
        decode_c = min(hi, max(lo, (1 - a) * decode_c + a * ratio))
    return prefill_c, decode_c


def _prefill_ratio(
    snap: MetricsSnapshot, cfg: PlannerConfig, previous: tuple[float, int] | None = None
) -> float | None:
    """Observed prefill compute time (TTFT minus queue wait) over the profile's prediction.

    Overloaded, latency says nothing about the model (the queue grows), but throughput
    does, as for decode: with requests waiting at both ends of the interval every ready
    replica was busy throughout, so the pool served the arrivals less the queue's growth,
    and the profile's time over the observed one is the ratio. A pool sized by a profile
    that is too fast is overloaded from the start and would otherwise never learn it."""
    if snap.ttft.count < cfg.min_requests_for_correction or snap.prefill.ready == 0:
        return None
    prof = cfg.profile.prefill
    mean_prompt = max(1.0, snap.mean_prompt_tokens * (1.0 - snap.cached_token_fraction))
    demand = snap.prompt_token_rate * (1.0 - snap.cached_token_fraction)
    mu = prof.saturated_tokens_per_s(mean_prompt)
    rho = demand / (snap.prefill.ready * mu)
    compute = snap.ttft.mean - snap.prefill_queue_wait_s
    if rho >= cfg.max_prefill_utilisation:
        return _prefill_throughput_ratio(snap, mean_prompt, demand, mu, previous)
    if compute <= 0:
        return None
    return compute / prof.service_time(mean_prompt)


def _prefill_throughput_ratio(
    snap: MetricsSnapshot,
    mean_prompt: float,
    demand: float,
    mu: float,
    previous: tuple[float, int] | None,
) -> float | None:
    if previous is None or snap.interval_s <= 0:
        return None
    depth, ready = previous
    if depth <= 0 or snap.prefill_queue_depth <= 0:
        return None  # not busy throughout the interval
    grown = (snap.prefill_queue_depth - depth) * mean_prompt / snap.interval_s
    served = demand - grown
    # pods that turned ready during the interval served part of it: count the fewer
    busy = min(ready, snap.prefill.ready)
    if served <= 0 or busy <= 0:
        return None
    return busy * mu / served


def _decode_ratio(snap: MetricsSnapshot, cfg: PlannerConfig) -> float | None:
    """Observed decode step time over the profile's prediction at the running batch.

    Normally from TPOT. With sequences waiting for a slot (or KV full) TPOT includes
    that wait, so the step time comes from throughput instead: every running sequence
    gains one token per step, so step = running / output tokens/s. A saturated pool is
    exactly when the correction matters most, so it must not stop learning there."""
    if snap.tpot.count < cfg.min_requests_for_correction or snap.decode.ready == 0:
        return None
    if snap.decode_running <= 0:
        return None
    prof = cfg.profile.decode
    batch = snap.decode_running / snap.decode.ready
    predicted = prof.step_time(max(1.0, batch), mean_context(snap, cfg))
    if snap.decode_waiting > 0 or snap.kv_utilisation >= 0.95:
        if snap.output_token_rate <= 0:
            return None
        return snap.decode_running / snap.output_token_rate / predicted
    if snap.tpot.mean <= 0:
        return None
    return snap.tpot.mean / predicted
