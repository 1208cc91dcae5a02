"""filter → score → pick, over one snapshot.

A scorer (router/scheduling/scorers.py, named in registry.py) maps a
worker and the request to a value in [0, 1]; the router sums them with weights
from config. Filters drop workers that cannot take the request. ``rank`` returns
every candidate best first (ties shuffled), so retries take the next one.

    candidates ──filters──▶ survivors ──Σ wᵢ·scorerᵢ──▶ sorted, ties random
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.router.config import ScorerWeight
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


Scorer = Callable[[WorkerView, RouteRequest], float]
Filter = Callable[[Sequence[WorkerView], RouteRequest], list[WorkerView]]


def get_scorer(name: str) -> Scorer:
    scorers = _registry()
    if name not in scorers:
        raise ValueError(f"unknown scorer {name!r}; valid: {sorted(scorers)}")
    return scorers[name]


@functools.cache
def _registry() -> dict[str, Scorer]:
    # The registry imports the scorers, which import this module's types: read it late, once.
    from pdserve.router.scheduling.registry import SCORERS

    return SCORERS


def weighted_score(worker: WorkerView, req: RouteRequest, weights: Sequence[ScorerWeight]) -> float:
    return _weighted(worker, req, _resolved(weights))


def _resolved(weights: Sequence[ScorerWeight]) -> list[tuple[str, float, Scorer]]:
    """(name, weight, scorer) of each weight: the registry looked up once per ranking."""
    return [(sw.name, sw.weight, get_scorer(sw.name)) for sw in weights]


def _weighted(
    worker: WorkerView, req: RouteRequest, scorers: list[tuple[str, float, Scorer]]
) -> float:
    total = 0.0
    for name, weight, scorer in scorers:
        value = scorer(worker, req)
        assert 0.0 <= value <= 1.0, f"scorer {name} returned {value}"
        total += weight * value
    return total


def rank(
    candidates: Sequence[WorkerView],
    req: RouteRequest,
    weights: Sequence[ScorerWeight],
    rng: random.Random,
    filters: Sequence[Filter] = (),
) -> list[WorkerView]:
    """Candidates best first; equal scores in random order. Workers a filter drops come
    last, still ranked: they are the retries of last resort (a busy worker beats none)."""
    survivors = list(candidates)
    for keep in filters:
        survivors = keep(survivors, req)
    if len(survivors) == len(candidates):  # filters only drop: none was
        return _sorted(survivors, req, weights, rng)
    rest = [w for w in candidates if w not in survivors]
    return _sorted(survivors, req, weights, rng) + _sorted(rest, req, weights, rng)


def _sorted(
    workers: Sequence[WorkerView],
    req: RouteRequest,
    weights: Sequence[ScorerWeight],
    rng: random.Random,
) -> list[WorkerView]:
    if len(workers) < 2:  # one worker's order needs no score (a pool of one: no scoring)
        return list(workers)
    scorers = _resolved(weights)
    keyed = [(round(_weighted(w, req, scorers), 9), rng.random(), w) for w in workers]
    keyed.sort(key=lambda t: (-t[0], t[1]))
    return [w for _, _, w in keyed]


def knows_lora(workers: Sequence[WorkerView], req: RouteRequest) -> list[WorkerView]:
    """Filter: for an adapter's request, the workers that can serve it without a path (their
    ``lora_known``); a worker not polled yet reports none, so it stays a last resort."""
    if req.lora is None:
        return list(workers)
    return [w for w in workers if req.lora in w.stats.lora_known]


def fits_kv(workers: Sequence[WorkerView], req: RouteRequest) -> list[WorkerView]:
    """Decode filter: workers with room for the prompt's blocks (when they report capacity)."""
    need = -(-req.num_prompt_tokens // max(req.block_size, 1))
    return [w for w in workers if w.stats.kv_blocks_total == 0 or w.stats.kv_blocks_free >= need]
