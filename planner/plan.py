"""The planner: one pure function from (snapshot, state, config) to (decision, state)."""

from __future__ import annotations

from dataclasses import replace

from pdserve.planner.ahead import decode_ahead, etas_for, prefill_ahead
from pdserve.planner.config import PlannerConfig
from pdserve.planner.decision import Decision, PlannerState, PoolDecision, PoolMemory
from pdserve.planner.model import update_corrections
from pdserve.planner.snapshot import MetricsSnapshot
from pdserve.planner.stability import PoolInput, stabilize


def plan(
    snapshot: MetricsSnapshot, state: PlannerState, config: PlannerConfig
) -> tuple[Decision, PlannerState]:
    """Desired prefill and decode replicas for this interval, and the state to pass next time.

    Pure: same inputs, same outputs; nothing is read from clocks or the network.
    """
    s, now = snapshot, snapshot.time_s
    prefill_c, decode_c = update_corrections(
        s, config, state.prefill_correction, state.decode_correction
    )
    fc = state.forecast.observe(
        now, s.interval_s, (s.request_rate, s.prompt_token_rate, s.output_token_rate),
        config.forecast,
    )  # fmt: skip
    p_etas = etas_for(state.prefill.etas, s.prefill, now, config.startup_s)
    d_etas = etas_for(state.decode.etas, s.decode, now, config.startup_s)
    p = prefill_ahead(s, config, prefill_c, fc, p_etas)
    da = decode_ahead(s, config, decode_c, fc, p)
    d = da.need
    p_in = PoolInput(
        "prefill", p.need, s.prefill, config.prefill, replace(state.prefill, etas=p_etas), now,
        p.steady_need, p.floor,
    )  # fmt: skip
    d_in = PoolInput(
        "decode", d.need, s.decode, config.decode, replace(state.decode, etas=d_etas), now,
        da.steady_need, da.floor,
    )  # fmt: skip
    p_dec, p_mem = stabilize(p_in, config.stability)
    d_dec, d_mem = stabilize(d_in, config.stability)
    p_mem = _started(p_dec, p_mem, now + config.startup_s)
    d_mem = _started(d_dec, d_mem, now + config.startup_s)
    if p.queue_at_ready > 0 and p_dec.desired > p_dec.current:
        p_dec = replace(
            p_dec,
            reason=p_dec.reason + f" (incl. {p.queue_at_ready:.0f} prompt tokens forecast queued "
            f"in {config.startup_s:.0f}s, {p.queue_now:.0f} now)",
        )
    details = {
        "forecast_request_rate": fc.request_rate.at(config.startup_s, config.forecast),
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
    decision = Decision(now, p_dec, d_dec, {k: round(v, 4) for k, v in details.items()})
    return decision, PlannerState(p_mem, d_mem, prefill_c, decode_c, fc)


def _started(dec: PoolDecision, mem: PoolMemory, eta: float) -> PoolMemory:
    """Remember when the pods this decision adds should be ready; a scale-down drops the
    newest ETAs first (unready pods are removed first)."""
    etas = mem.etas
    if dec.desired > dec.current:
        etas = etas + (eta,) * (dec.desired - dec.current)
    elif dec.desired < dec.current:
        etas = etas[: max(0, len(etas) - (dec.current - dec.desired))]
    return replace(mem, etas=etas)
