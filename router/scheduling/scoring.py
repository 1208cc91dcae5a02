"""The weighted sum of a profile's scorers, and workers ordered by it.

A scorer (router/scheduling/scorers.py, named in registry.py) maps a worker and the
request to a value in [0, 1]; the router sums them with weights from config, and the
max-score picker (pickers.py) orders workers by that sum, ties shuffled.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdserve.router.scheduling.route_request import RouteRequest, WeightedScorer
from pdserve.router.scheduling.snapshot import WorkerView


def weighted_score(
    worker: WorkerView, req: RouteRequest, scorers: Sequence[WeightedScorer]
) -> float:
    total = 0.0
    for name, weight, scorer in scorers:
        value = scorer(worker, req)
        assert 0.0 <= value <= 1.0, f"scorer {name} returned {value}"
        total += weight * value
    return total


def by_score(
    workers: Sequence[WorkerView],
    req: RouteRequest,
    scorers: Sequence[WeightedScorer],
    rng: random.Random,
) -> list[WorkerView]:
    """``workers`` best weighted score first; equal scores in random order."""
    if len(workers) < 2:  # one worker's order needs no score (a pool of one: no scoring)
        return list(workers)
    keyed = [(round(weighted_score(w, req, scorers), 9), rng.random(), w) for w in workers]
    keyed.sort(key=lambda t: (-t[0], t[1]))
    return [w for _, _, w in keyed]
