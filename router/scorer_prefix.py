"""Scorer ``prefix-match``: the share of the prompt's full blocks the worker already holds."""

from __future__ import annotations

from pdserve.router.scoring import RouteRequest, register_scorer
from pdserve.router.snapshot import WorkerView


@register_scorer("prefix-match")
def prefix_match(worker: WorkerView, req: RouteRequest) -> float:
    if not req.block_hashes:
        return 0.0
    matched = req.matched_blocks.get(worker.worker_id, 0)
    return min(matched, len(req.block_hashes)) / len(req.block_hashes)
