"""The router's scheduler: one request's plan, and the state planning keeps.

    prompt ids ─▶ block hashes (the service's hash key, seeded by salt and adapter)
               ─▶ prefix index match (and KV tier match) ─▶ RouteRequest
               ─▶ plan_route(snapshot) (routing.py: filter → score → pick, P/D decision)
               ─▶ decision metrics; a remote prefill's blocks stored in the index at once

It owns the block-hash key, the prefix index's match and store, the round-robin counter
and the decision metrics. The API (router/api/serving.py), the endpoint picker
(router/picker/pick.py) and tests call ``plan``; transport (router/transport/dispatch.py)
runs the plan it returns and plans nothing itself.
"""

from __future__ import annotations

import random

from pdserve.protocol.contract import LoraRef
from pdserve.protocol.hashing import block_hashes, hash_key, salt_root
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.prefix_index import PrefixIndex
from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.routing import NoWorkerAvailable, RoutePlan, plan_route
from pdserve.router.scheduling.snapshot import Snapshot


class Scheduler:
    def __init__(
        self,
        cfg: RouterConfig,
        index: PrefixIndex,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._rr = 0
        self.hash_key = hash_key()  # the service's block-hash key, as the workers'

    def plan(
        self,
        ids: list[int],
        snap: Snapshot,
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
    ) -> RoutePlan:
        prefix = self.cfg.uses_prefix
        # The adapter's hash seeds the chain as on the workers: their KV events match these.
        root = salt_root(cache_salt, lora.hash if lora is not None else None)
        hashes = block_hashes(ids, snap.block_size, root, self.hash_key) if prefix else []
        pool = self.index.match(hashes)
        tiers = self.index.tiers.match(hashes, pool, (w.worker_id for w in snap.prefill))
        req = RouteRequest(
            len(ids),
            tuple(hashes),
            snap.block_size,
            pool,
            self.index.held() if prefix else {},
            lora.name if lora is not None else None,
            tiers,
        )
        try:
            plan = plan_route(snap, req, self.cfg, self.rng, self._rr)
        except NoWorkerAvailable as exc:
            raise APIError(503, f"no worker is ready: {exc}", code="no_worker") from exc
        self._rr += 1
        self.metrics.child(self.metrics.decisions, plan.kind).inc()
        if lora is not None:
            self._count_lora(plan, lora.name)
        if plan.kind == disagg.REMOTE_PREFILL:
            self.metrics.prefix_match.observe(plan.match_ratio(len(ids)))
            if prefix:  # the next request of this prefix should follow before the event lands
                self.index.stored(plan.prefill[0].worker_id, hashes)
        return plan

    def _count_lora(self, plan: RoutePlan, name: str) -> None:
        for role, workers in (("prefill", plan.prefill), ("decode", plan.decode)):
            if workers:
                resident = "true" if name in workers[0].stats.loras else "false"
                self.metrics.child(self.metrics.lora_routed, role, resident).inc()
