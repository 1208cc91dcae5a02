"""Scorer ``free-kv``: the fraction of the worker's KV blocks that are free."""

from __future__ import annotations

from pdserve.router.scoring import RouteRequest, register_scorer
from pdserve.router.snapshot import WorkerView


@register_scorer("free-kv")
def free_kv(worker: WorkerView, req: RouteRequest) -> float:
    return min(max(worker.kv_free_fraction, 0.0), 1.0)
