"""The planner: one pure function from (snapshot, state, config) to (decision, state)."""

from __future__ import annotations

from dataclasses import replace

from pdserve.planner.ahead import DecodeAhead, PrefillAhead, decode_ahead, etas_for, prefill_ahead
from pdserve.planner.config import PlannerConfig
from pdserve.planner.decision import Decision, PlannerState, PoolDecision, PoolMemory
from pdserve.planner.forecast import Forecast
from pdserve.planner.mix import COLOCATED, decide_mode
from pdserve.planner.model import FALLBACK_OUTPUT_TOKENS, update_corrections
from pdserve.planner.snapshot import MetricsSnapshot
from pdserve.planner.stability import PoolInput, stabilize


def plan(
    snapshot: MetricsSnapshot, state: PlannerState, config: PlannerConfig
) -> tuple[Decision, PlannerState]:
    """Desired prefill and decode replicas for this interval, and the state to pass next time.

    Pure: same inputs, same outputs; nothing is read from clocks or the network.
    """
    s, now = snapshot, snapshot.time_s
    previous = (state.prefill_queue_depth, state.prefill_ready)
    prefill_c, decode_c = update_corrections(
        s, config, state.prefill_correction, state.decode_correction, previous
    )
    fc = state.forecast.observe(
        now,
        s.interval_s,
        (s.request_rate, s.prompt_token_rate, s.output_token_rate),
        config.forecast,
    )
    if fc.request_rate.collapsed:
        state = replace(
            state,
            prefill=_remember(state.prefill, s.prefill.current, now),
            decode=_remember(state.decode, s.decode.current, now),
        )
    p_etas = etas_for(state.prefill.etas, s.prefill, now, config.startup_s)
    d_etas = etas_for(state.decode.etas, s.decode, now, config.startup_s)
    if s.prefill.current == 0:  # no prefill pool: the decode workers prefill locally
        p = prefill_ahead(s, config, prefill_c, fc, d_etas, s.decode.ready)
    else:
        p = prefill_ahead(s, config, prefill_c, fc, p_etas)
    da = decode_ahead(s, config, decode_c, fc, p)
    rate = fc.request_rate.at(config.startup_s, config.forecast)
    out = _mean_output(s, fc)
    choice, mode, mix_why = decide_mode(config, p.mean_prompt, out, state.mode, rate)
    if mode == COLOCATED:
        p, da = _colocated(p, da, fc, config, choice.colocated_goodput)
    d = da.need
    ready_at = now + config.startup_s

    def decided(
        role: str, need: float, steady: float, floor: float, etas: tuple[float, ...], rising: bool
    ) -> tuple[PoolDecision, PoolMemory]:
        """The pool's decision, stabilized, and its memory (starts counted)."""
        memory = replace(getattr(state, role), etas=etas)
        inp = PoolInput(
            role, need, getattr(s, role), getattr(config, role), memory, now, steady, floor, rising
        )
        dec, mem = stabilize(inp, config.stability)
        return dec, _started(dec, mem, ready_at)

    uptrend = fc.request_rate.uptrend
    p_dec, p_mem = decided(
        "prefill", p.need, p.steady_need, p.floor, p_etas, uptrend or fc.prompt_rate.uptrend
    )
    d_dec, d_mem = decided(
        "decode", d.need, da.steady_need, da.floor, d_etas, uptrend or fc.output_rate.uptrend
    )
    if p.queue_at_ready > 0 and p_dec.desired > p_dec.current:
        p_dec = replace(
            p_dec,
            reason=p_dec.reason + f" (incl. {p.queue_at_ready:.0f} prompt tokens forecast queued "
            f"in {config.startup_s:.0f}s, {p.queue_now:.0f} now)",
        )
    details = {
        "forecast_request_rate": fc.request_rate.at(config.startup_s, config.forecast),
        "startup_s": config.startup_s,  # the horizon: configured, or measured (startup.py)
        "prefill_need": p.need,
        "prefill_tokens_per_replica_s": p.tokens_per_replica_s,
        "prefill_target_utilisation": p.target_utilisation,
        "prefill_demand_tokens_per_s": p.demand_now,
        "prefill_demand_at_ready": p.demand_at_ready,
        "prefill_backlog_tokens": p.queue_now,
        "prefill_queue_at_ready": p.queue_at_ready,
        "prefill_starting": float(len(p_etas)),
        "prefill_correction": prefill_c,
        "decode_need": d.need,
        "decode_batch_per_replica": d.batch_per_replica,
        "decode_tokens_per_replica": d.tokens_per_replica,
        "decode_mean_context": d.mean_context,
        "decode_need_sequences": d.by_sequences,
        "decode_need_tokens": d.by_tokens,
        "decode_need_kv": d.by_kv,
        "decode_starting": float(len(d_etas)),
        "decode_correction": decode_c,
    }
    details["mix_prefill_share"] = choice.prefill_share
    details["mix_disagg_goodput_per_replica"] = choice.disagg_goodput
    details["mix_colocated_goodput_per_replica"] = choice.colocated_goodput
    rounded = {k: round(v, 4) for k, v in details.items()}
    decision = Decision(now, p_dec, d_dec, rounded, mode, mix_why)
    return decision, PlannerState(
        p_mem,
        d_mem,
        prefill_c,
        decode_c,
        fc,
        mode,
        prefill_queue_depth=s.prefill_queue_depth,
        prefill_ready=s.prefill.ready,
    )


def _mean_output(s: MetricsSnapshot, fc: Forecast) -> float:
    return fc.output_per_request or s.mean_output_tokens or FALLBACK_OUTPUT_TOKENS


def _colocated(
    p: PrefillAhead, da: DecodeAhead, fc: Forecast, cfg: PlannerConfig, goodput: float
) -> tuple[PrefillAhead, DecodeAhead]:
    """No prefill pool: the decode pool serves the whole request rate at the colocated
    goodput per replica, plus the prefill queue forecast for when new pods are ready."""
    h = cfg.startup_s
    rate_t = fc.request_rate.at(h, cfg.forecast)
    peak = fc.request_rate.peak(h, cfg.forecast)
    queue = p.queue_at_ready / (p.tokens_per_replica_s * cfg.queue_drain_s)
    need = max(da.need.need, rate_t / goodput + queue)
    now = (fc.request_rate.level or 0.0) / goodput
    da = DecodeAhead(
        replace(da.need, need=need), max(da.steady_need, now), max(da.floor, peak / goodput)
    )
    return replace(p, need=0.0, steady_need=0.0, floor=0.0), da


def _remember(mem: PoolMemory, count: int, now: float) -> PoolMemory:
    """The request rate collapsed (forecast.COLLAPSE): the scale-down window remembers the
    count in force, so the pool keeps it for one window. A collapse is an outage upstream
    more often than a change of demand, and its load comes back within seconds, with the
    retries on top, while pods ordered then serve a start-up later; a drop that lasts only
    costs the window's replica-seconds."""
    return replace(mem, history=(*mem.history, (now, count)))


def _started(dec: PoolDecision, mem: PoolMemory, eta: float) -> PoolMemory:
    """Remember when the pods this decision adds should be ready; a scale-down drops the
    newest ETAs first (unready pods are removed first)."""
    etas = mem.etas
    if dec.desired > dec.current:
        etas = etas + (eta,) * (dec.desired - dec.current)
    elif dec.desired < dec.current:
        etas = etas[: max(0, len(etas) - (dec.current - dec.desired))]
    return replace(mem, etas=etas)
