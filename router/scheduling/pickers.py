"""The built-in pickers: each orders a pool's workers, best first (named in
router/scheduling/registry.py). The first is the request's worker; the others are its
retries, in order."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.router.scheduling.route_request import RouteRequest, WeightedScorer
from pdserve.router.scheduling.scoring import by_score
from pdserve.router.scheduling.snapshot import WorkerView

# (workers, request, the profile's weighted scorers, rng, the round-robin counter) → order
Order = Callable[
    [Sequence[WorkerView], RouteRequest, Sequence[WeightedScorer], random.Random, int],
    list[WorkerView],
]


@dataclass(frozen=True)
class Picker:
    order: Order
    scores: bool  # whether it reads the scorers (a prefix scorer then needs block hashes)


def max_score(
    workers: Sequence[WorkerView],
    req: RouteRequest,
    scorers: Sequence[WeightedScorer],
    rng: random.Random,
    counter: int,
) -> list[WorkerView]:
    """The best weighted score of the profile's scorers first; ties in random order."""
    return by_score(workers, req, scorers, rng)


def round_robin(
    workers: Sequence[WorkerView],
    req: RouteRequest,
    scorers: Sequence[WeightedScorer],
    rng: random.Random,
    counter: int,
) -> list[WorkerView]:
    """Rotation over the workers by URL, one step a request (a baseline: no scores)."""
    ordered = sorted(workers, key=lambda w: w.url)
    if not ordered:
        return []
    k = counter % len(ordered)
    return ordered[k:] + ordered[:k]
