"""Routing: a pure function from (snapshot, request, config) to a plan.

No I/O, no clocks; randomness comes in as an ``rng`` and round-robin state as a
counter, so every decision can be replayed from a table in tests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.router.config import RouterConfig
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView


class NoWorkerAvailable(RuntimeError):
    """No healthy worker can serve the request (the API answers 503)."""


@dataclass(frozen=True)
class RoutePlan:
    kind: str  # disagg.REMOTE_PREFILL | disagg.LOCAL_PREFILL
    prefill: tuple[WorkerView, ...]  # best first; empty for local prefill
    decode: tuple[WorkerView, ...]  # best first
    matched_tokens: int  # prompt tokens cached on prefill[0] (0 for local prefill)

    def match_ratio(self, num_prompt_tokens: int) -> float:
        return self.matched_tokens / num_prompt_tokens if num_prompt_tokens else 0.0


def rank_decode(
    snap: Snapshot, req: RouteRequest, cfg: RouterConfig, rng: random.Random, rr_counter: int = 0
) -> list[WorkerView]:
    return cfg.decode_profile.order(snap.decode, req, rng, rr_counter)


def rank_prefill(
    snap: Snapshot, req: RouteRequest, cfg: RouterConfig, rng: random.Random, rr_counter: int = 0
) -> list[WorkerView]:
    return cfg.prefill_profile.order(snap.prefill, req, rng, rr_counter)


def plan_route(
    snap: Snapshot, req: RouteRequest, cfg: RouterConfig, rng: random.Random, rr_counter: int = 0
) -> RoutePlan:
    """Decode candidates, the prefill/decode decision, then prefill candidates (ranked only
    for a prompt that goes to one: a short prompt's plan skips the prefill pool's scoring)."""
    decode = rank_decode(snap, req, cfg, rng, rr_counter)
    if not decode:
        raise NoWorkerAvailable("no healthy decode worker")
    cached = req.matched_tokens(decode[0].worker_id)
    kind = disagg.decide(
        req.num_prompt_tokens, cached, cfg.disagg_threshold, have_prefill=bool(snap.prefill)
    )
    if kind == disagg.LOCAL_PREFILL:
        return RoutePlan(kind, (), tuple(decode), 0)
    prefill = rank_prefill(snap, req, cfg, rng, rr_counter)
    if not prefill:  # a guard: rank keeps filtered workers (last), so a pool is never empty
        return RoutePlan(disagg.LOCAL_PREFILL, (), tuple(decode), 0)
    return RoutePlan(kind, tuple(prefill), tuple(decode), req.matched_tokens(prefill[0].worker_id))
