"""The built-in scorers: each maps (worker, request) to a score in [0, 1], higher is better.

They are plain functions; router/scheduling/registry.py names them. Load scorers map a load
``x`` to ``1 / (1 + x / scale)``: 1 when idle, 0.5 at ``scale``, towards 0 as the queue grows,
so no single outlier flattens everyone else's score.
"""

from __future__ import annotations

from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.snapshot import WorkerView

QUEUED_TOKENS_SCALE = 2048.0
RUNNING_SCALE = 8.0


def _inverse(load: float, scale: float) -> float:
    return 1.0 / (1.0 + max(load, 0.0) / scale)


def prefix_match(worker: WorkerView, req: RouteRequest) -> float:
    """The share of the prompt's full blocks the worker already holds; a block in a KV tier
    below a pool counts at its tier's weight (router/scheduling/tier_index.py)."""
    if not req.block_hashes:
        return 0.0
    matched = max(
        req.matched_blocks.get(worker.worker_id, 0), req.tier_matched.get(worker.worker_id, 0.0)
    )
    return min(matched, len(req.block_hashes)) / len(req.block_hashes)


def queued_tokens(worker: WorkerView, req: RouteRequest) -> float:
    """Fewer tokens waiting at the worker scores higher."""
    return _inverse(worker.queued_tokens, QUEUED_TOKENS_SCALE)


def running(worker: WorkerView, req: RouteRequest) -> float:
    """Fewer requests running at the worker scores higher."""
    return _inverse(worker.running, RUNNING_SCALE)


def free_kv(worker: WorkerView, req: RouteRequest) -> float:
    """The fraction of the worker's KV blocks that are free."""
    return min(max(worker.kv_free_fraction, 0.0), 1.0)


def cache_balance(worker: WorkerView, req: RouteRequest) -> float:
    """Spread new prefixes over the workers' caches.

    A prompt that matches no cache should go where fewer blocks are cached, so that the
    groups of a workload divide the total cache instead of crowding one worker's (and
    evicting each other there). Score: ``1 - held / total held`` over all workers, 1 when
    nothing is cached anywhere.
    """
    total = sum(req.held_blocks.values())
    if total <= 0:
        return 1.0
    return 1.0 - min(req.held_blocks.get(worker.worker_id, 0), total) / total


def lora_affinity(worker: WorkerView, req: RouteRequest) -> float:
    """1 when the request names an adapter that the worker holds resident now (its
    ``/stats`` ``loras``): no load before its first step. 0 otherwise, and 0 on every
    worker for a base-model request (the scorer then orders nothing)."""
    return 1.0 if req.lora is not None and req.lora in worker.stats.loras else 0.0
