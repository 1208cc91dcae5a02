"""Scorer ``cache-balance``: spread new prefixes over the workers' caches.

A prompt that matches no cache should go where fewer blocks are cached, so
that the groups of a workload divide the total cache instead of crowding one
worker's (and evicting each other there). Score: ``1 - held / total held``
over all workers, 1 when nothing is cached anywhere.
"""

from __future__ import annotations

from pdserve.router.scoring import RouteRequest, register_scorer
from pdserve.router.snapshot import WorkerView


@register_scorer("cache-balance")
def cache_balance(worker: WorkerView, req: RouteRequest) -> float:
    total = sum(req.held_blocks.values())
    if total <= 0:
        return 1.0
    return 1.0 - min(req.held_blocks.get(worker.worker_id, 0), total) / total
