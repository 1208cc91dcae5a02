"""The planner: one pure function from (snapshot, state, config) to (decision, state)."""

from __future__ import annotations

from dataclasses import replace

from pdserve.planner.config import PlannerConfig
from pdserve.planner.decision import Decision, PlannerState
from pdserve.planner.model import decode_need, growth, prefill_need, update_corrections
from pdserve.planner.snapshot import MetricsSnapshot
from pdserve.planner.stability import PoolInput, stabilize


def plan(
    snapshot: MetricsSnapshot, state: PlannerState, config: PlannerConfig
) -> tuple[Decision, PlannerState]:
    """Desired prefill and decode replicas for this interval, and the state to pass next time.

    Pure: same inputs, same outputs; nothing is read from clocks or the network.
    """
    prefill_c, decode_c = update_corrections(
        snapshot, config, state.prefill_correction, state.decode_correction
    )
    grow = growth(snapshot, config, state.last_request_rate)
    p = prefill_need(snapshot, config, prefill_c, grow)
    d = decode_need(snapshot, config, decode_c, grow)
    now, stab = snapshot.time_s, config.stability
    p_in = PoolInput(
        "prefill", p.need, snapshot.prefill, config.prefill, state.prefill, now, p.steady_need
    )
    d_in = PoolInput(
        "decode", d.need, snapshot.decode, config.decode, state.decode, now, d.steady_need
    )
    p_dec, p_mem = stabilize(p_in, stab)
    d_dec, d_mem = stabilize(d_in, stab)
    if p.backlog_tokens > 0 and p_dec.desired > p_dec.current:
        p_dec = replace(
            p_dec, reason=p_dec.reason + f" (incl. {p.backlog_tokens:.0f} queued prompt tokens)"
        )
    details = {
        "load_growth": grow,
        "prefill_need": p.need,
        "prefill_capacity_tokens_per_s": p.capacity_per_replica,
        "prefill_target_utilisation": p.target_utilisation,
        "prefill_demand_tokens_per_s": p.demand_tokens_per_s,
        "prefill_backlog_tokens": p.backlog_tokens,
        "prefill_correction": prefill_c,
        "decode_need": d.need,
        "decode_batch_per_replica": d.batch_per_replica,
        "decode_tokens_per_replica": d.tokens_per_replica,
        "decode_mean_context": d.mean_context,
        "decode_need_sequences": d.by_sequences,
        "decode_need_tokens": d.by_tokens,
        "decode_need_kv": d.by_kv,
        "decode_correction": decode_c,
    }
    decision = Decision(snapshot.time_s, p_dec, d_dec, {k: round(v, 4) for k, v in details.items()})
    new_state = PlannerState(p_mem, d_mem, prefill_c, decode_c, snapshot.request_rate)
    return decision, new_state
