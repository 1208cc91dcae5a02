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

Workers = Sequence[WorkerView]
Scorers = Sequence[WeightedScorer]  # the profile's, with their weights
# (workers, request, scorers, rng, the round-robin counter) → the workers best first
Order = Callable[[Workers, RouteRequest, Scorers, random.Random, int], list[WorkerView]]


@dataclass(frozen=True)
class Picker:
    order: Order
    scores: bool  # whether it reads the scorers (a prefix scorer then needs block hashes)


def max_score(
    w: Workers, req: RouteRequest, s: Scorers, rng: random.Random, n: int
) -> list[WorkerView]:
    """The best weighted score of the profile's scorers first; ties in random order."""
    return by_score(w, req, s, rng)


def round_robin(
    w: Workers, req: RouteRequest, s: Scorers, rng: random.Random, n: int
) -> list[WorkerView]:
    """Rotation over the workers by URL, one step (``n``) a request (a baseline: no scores)."""
    ordered = sorted(w, key=lambda x: x.url)
    if not ordered:
        return []
    k = n % len(ordered)
    return ordered[k:] + ordered[:k]
