"""What the compiled lane's planner (rust/router_lane/src/plan.rs, ``pdserve_lane.Planner``)
is given: the router's profiles by registry name, and the snapshot's workers as rows.

The Rust planner makes ``Scheduler.plan``'s decision for a base-model request (block
hashes, the prefix index's match and store, filters, weighted scorers, the picker with
its ties broken by the same Mersenne Twister draws, the round-robin counter, the P/D
decision) over what Python mirrors into it; the Python scheduler stays the reference
(tests/router/test_lane_plan.py: the same stream of requests, loads and KV events gives
the same plans). docs/router.md, "Ninth pass".
"""

from __future__ import annotations

from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.scheduling.profile import Profile
from pdserve.router.scheduling.registry import FILTERS, PICKERS
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

# (filters, [(scorer, weight)], picker): a profile by the names the registry gives it
ProfileSpec = tuple[list[str], list[tuple[str, float]], str]


def profile_spec(profile: Profile) -> ProfileSpec:
    """``profile`` by name (its plugins are the registry's functions: looked up back)."""
    filters = [name for f in profile.filters for name, g in FILTERS.items() if g is f]
    picker = next(name for name, p in PICKERS.items() if p is profile.picker)
    assert len(filters) == len(profile.filters), "a filter the registry does not name"
    return filters, [(name, weight) for name, weight, _ in profile.scorers], picker


def planner(module: Any, cfg: RouterConfig, key: bytes) -> Any:
    """A ``pdserve_lane.Planner`` for ``cfg`` (its profiles, threshold and index bound) and
    the service's block-hash ``key`` (``hashing.hash_key()``)."""
    return module.Planner(
        profile_spec(cfg.prefill_profile),
        profile_spec(cfg.decode_profile),
        cfg.disagg_threshold,
        key,
        cfg.prefix_index_capacity,
    )


def worker_row(w: WorkerView) -> tuple[Any, ...]:
    """One worker as ``Planner.set_workers`` reads it (planner_py.rs ``WorkerRow``)."""
    s = w.stats
    return (
        w.url,
        w.worker_id,
        w.role == "prefill",
        w.healthy,
        w.reported,
        [
            s.queued_prompt_tokens,
            s.running + s.waiting + s.loading,
            s.kv_blocks_total,
            s.kv_blocks_free,
            s.block_size,
            w.inflight,
            w.inflight_prompt_tokens,
            w.since_report,
            w.since_report_tokens,
        ],
    )


def rows(snap: Snapshot) -> list[tuple[Any, ...]]:
    return [worker_row(w) for w in snap.workers]
