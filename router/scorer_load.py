"""Scorers ``queued-tokens`` and ``running``: lighter load scores higher.

Both map a load ``x`` to ``1 / (1 + x / scale)``: 1 when idle, 0.5 at ``scale``,
towards 0 as the queue grows, so no single outlier flattens everyone else's score.
"""

from __future__ import annotations

from pdserve.router.scoring import RouteRequest, register_scorer
from pdserve.router.snapshot import WorkerView

QUEUED_TOKENS_SCALE = 2048.0
RUNNING_SCALE = 8.0


def _inverse(load: float, scale: float) -> float:
    return 1.0 / (1.0 + max(load, 0.0) / scale)


@register_scorer("queued-tokens")
def queued_tokens(worker: WorkerView, req: RouteRequest) -> float:
    return _inverse(worker.queued_tokens, QUEUED_TOKENS_SCALE)


@register_scorer("running")
def running(worker: WorkerView, req: RouteRequest) -> float:
    return _inverse(worker.running, RUNNING_SCALE)
