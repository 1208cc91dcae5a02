"""The built-in filters: each keeps the workers that can take the request (named in
router/scheduling/registry.py; a profile runs its filters in order, profile.py)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.snapshot import WorkerView


def knows_lora(workers: Sequence[WorkerView], req: RouteRequest) -> list[WorkerView]:
    """For an adapter's request, the workers that can serve it without a path (their
    ``lora_known``); a worker not polled yet reports none, so it stays a last resort."""
    if req.lora is None:
        return list(workers)
    return [w for w in workers if req.lora in w.stats.lora_known]


def fits_kv(workers: Sequence[WorkerView], req: RouteRequest) -> list[WorkerView]:
    """Workers with room for the prompt's blocks (when they report capacity)."""
    need = -(-req.num_prompt_tokens // max(req.block_size, 1))
    return [w for w in workers if w.stats.kv_blocks_total == 0 or w.stats.kv_blocks_free >= need]
