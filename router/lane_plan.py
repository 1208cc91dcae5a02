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

import logging
from collections.abc import Sequence
from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.prefix_index import PrefixIndex
from pdserve.router.scheduling.profile import Profile
from pdserve.router.scheduling.registry import FILTERS, PICKERS
from pdserve.router.scheduling.scheduler import Scheduler
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

log = logging.getLogger(__name__)

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


class LanePlanner:
    """``Scheduler.plan`` for the lane's requests, made by the Rust planner: the snapshot's
    rows are sent when a worker's view moved (Discovery reuses an unchanged worker's view
    object), the prefix index is mirrored (``PrefixIndex.attach``: every KV event and every
    plan Python makes), and the round-robin counter is the scheduler's. A request the Rust
    side declines (a KV tier holds blocks) is planned by the scheduler. The decision
    metrics are counted here as the scheduler counts them.

    A value the Rust side cannot hold (a block hash outside 128 bits from a worker's KV
    event, a count outside 64 bits) never fails the index or the request: a row's is
    planned by the scheduler that once, an index change's leaves the mirror behind, and
    the scheduler plans every request from then on (logged once)."""

    def __init__(self, rust: Any, scheduler: Scheduler, index: PrefixIndex) -> None:
        self.rust, self.sched = rust, scheduler
        self._shown: tuple[WorkerView, ...] = ()
        self.synced = True
        index.attach(self)

    # -- the index's mirror (prefix_index.Mirror) -----------------------------------------
    def kv_stored(self, worker_id: str, hashes: Sequence[int]) -> None:
        self._mirror(self.rust.kv_stored, worker_id, hashes)

    def kv_removed(self, worker_id: str, hashes: Sequence[int]) -> None:
        self._mirror(self.rust.kv_removed, worker_id, hashes)

    def kv_drop(self, worker_id: str) -> None:
        self._mirror(self.rust.kv_drop, worker_id)

    def set_tiers_present(self, present: bool) -> None:
        self.rust.set_tiers_present(present)

    def _mirror(self, call: Any, *args: Any) -> None:
        if not self.synced:
            return
        try:
            call(*args)
        except BAD_VALUE as exc:
            self.synced = False
            log.warning(
                "fast lane: the prefix index left the Rust planner (%s); the scheduler "
                "plans from now on",
                exc,
            )

    def plan(self, ids: list[int], snap: Snapshot, salt: str | None) -> Planned:
        sched = self.sched
        if not self.synced:
            return python_plan(sched, ids, snap, salt)
        views = snap.workers
        shown = self._shown
        try:
            if len(views) != len(shown) or any(
                a is not b for a, b in zip(views, shown, strict=True)
            ):
                self._shown = ()  # until the rows are in
                self.rust.set_workers(rows(snap))
                self._shown = views
            self.rust.rr = sched._rr
            got = self.rust.plan(ids, salt)
        except BAD_VALUE:  # a count or an id outside 64 bits: the scheduler decides
            return python_plan(sched, ids, snap, salt)
        if got is None:
            return python_plan(sched, ids, snap, salt)
        if len(got) == 1:  # ("no_worker",): as the scheduler's NoWorkerAvailable
            raise APIError(503, f"no worker is ready: {NO_DECODE}", code="no_worker")
        kind, prefill, decode, matched = got
        sched._rr = self.rust.rr
        m = sched.metrics
        m.child(m.decisions, kind).inc()
        if kind == disagg.REMOTE_PREFILL:
            m.prefix_match.observe(matched / len(ids) if ids else 0.0)
        return kind, prefill, decode


BAD_VALUE = (OverflowError, TypeError, ValueError)  # what PyO3 raises for a value out of range
NO_DECODE = "no healthy decode worker"  # routing.plan_route's NoWorkerAvailable
Planned = tuple[str, list[str], list[str]]  # kind, prefill URLs, decode URLs (best first)


def python_plan(sched: Scheduler, ids: list[int], snap: Snapshot, salt: str | None) -> Planned:
    plan = sched.plan(ids, snap, salt, None)
    return plan.kind, [w.url for w in plan.prefill], [w.url for w in plan.decode]
