"""One pool's scheduling profile (prefill or decode): its filters, weighted scorers and
picker, composed from configuration by registry name (router/config.py builds one per
pool, once).

    candidates ──filters──▶ survivors ──picker (Σ wᵢ·scorerᵢ)──▶ best first
                            the rest  ──picker──────────────────▶ after them

Workers a filter drops come last, still ordered: they are the retries of last resort (a
busy worker beats none).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.router.scheduling.pickers import Picker
from pdserve.router.scheduling.registry import get_filter, get_picker, get_scorer
from pdserve.router.scheduling.route_request import (
    Filter,
    RouteRequest,
    ScorerWeight,
    WeightedScorer,
)
from pdserve.router.scheduling.snapshot import WorkerView


@dataclass(frozen=True)
class Profile:
    filters: tuple[Filter, ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Picker

    def order(
        self, candidates: Sequence[WorkerView], req: RouteRequest, rng: random.Random, counter: int
    ) -> list[WorkerView]:
        survivors = list(candidates)
        for keep in self.filters:
            survivors = keep(survivors, req)
        pick = self.picker.order
        if len(survivors) == len(candidates):  # filters only drop: none was
            return pick(survivors, req, self.scorers, rng, counter)
        rest = [w for w in candidates if w not in survivors]
        return pick(survivors, req, self.scorers, rng, counter) + pick(
            rest, req, self.scorers, rng, counter
        )

    def reads(self, scorer: str) -> bool:
        """Whether the picker reads ``scorer`` with a weight above 0."""
        return self.picker.scores and any(n == scorer and w > 0 for n, w, _ in self.scorers)


def build_profile(filters: Sequence[str], weights: Sequence[ScorerWeight], picker: str) -> Profile:
    """The plugins named, looked up once; an unknown name fails by name (ValueError)."""
    return Profile(
        tuple(get_filter(name) for name in filters),
        tuple((sw.name, sw.weight, get_scorer(sw.name)) for sw in weights),
        get_picker(picker),
    )
