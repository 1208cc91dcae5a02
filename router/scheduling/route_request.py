"""What the scheduling plugins take: the request as routing sees it, and the plugin types.

A filter keeps the workers that can take the request, a scorer maps (worker, request) to
[0, 1], a picker orders workers (router/scheduling/pickers.py). registry.py names them all;
profile.py composes one pool's filters, weighted scorers and picker from configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.router.scheduling.snapshot import WorkerView


@dataclass(frozen=True)
class RouteRequest:
    """What routing knows about one request (all computed before routing)."""

    num_prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    block_size: int = 16
    # worker_id -> number of leading prompt blocks that worker holds (from the prefix index)
    matched_blocks: Mapping[str, int] = field(default_factory=dict)
    # worker_id -> blocks the prefix index says the worker caches (any prompt)
    held_blocks: Mapping[str, int] = field(default_factory=dict)
    lora: str | None = None  # the adapter the request names (None: the base model)
    # worker_id -> leading blocks weighted by where the worker has them: its pool (1), its
    # KV tiers or the shared one (their weights); empty when no tier holds any (tier_index.py)
    tier_matched: Mapping[str, float] = field(default_factory=dict)

    def matched_tokens(self, worker_id: str) -> int:
        return min(self.matched_blocks.get(worker_id, 0) * self.block_size, self.num_prompt_tokens)


@dataclass(frozen=True)
class ScorerWeight:
    """One scorer plugin (by registry key) and its weight in the weighted sum."""

    name: str
    weight: float


Scorer = Callable[[WorkerView, RouteRequest], float]
Filter = Callable[[Sequence[WorkerView], RouteRequest], list[WorkerView]]
WeightedScorer = tuple[str, float, Scorer]  # (registry name, weight, the scorer)
