"""What one scheduler step hands the model runner: the chunks to compute, and the
requests it preempted or whose remote KV finished loading. Torch-free: the scheduler
(scheduler.py) builds it, the model runner (model_runner.py) and CUDA graphs
(cuda_graphs.py) read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.kv_connector import LoadResult
from pdserve.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start .. start + num_tokens`` of one request, computed in one step; with
    ``draft`` (speculative decoding, engine/spec_decode.py) the last ``len(draft)`` of them
    are draft tokens past the request's own, and each of the last ``1 + len(draft)`` rows
    is sampled."""

    request: Request
    num_tokens: int
    start: int
    samples: bool  # the chunk reaches the request's last token: its logits are sampled
    draft: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: Request, num_tokens: int, draft: Sequence[int] = ()) -> ScheduledChunk:
        start = request.num_computed_tokens
        samples = start + num_tokens == request.num_tokens
        return cls(request, num_tokens + len(draft), start, samples, tuple(draft))

    @property
    def num_rows(self) -> int:
        """Rows of logits the chunk samples."""
        return 1 + len(self.draft) if self.samples else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    loaded: list[tuple[Request, LoadResult]] = field(default_factory=list)
