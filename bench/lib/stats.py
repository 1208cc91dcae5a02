"""Percentiles and the spread of repeated runs, one definition for every bench."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``q`` in [0, 1]) of ``values``; 0.0 when empty.

    Nearest rank on the (n - 1) scale (numpy's ``method="nearest"``): a reported p90 is
    always one of the measured values, never an interpolation between two runs.
    """
    if not values:
        return 0.0
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


def median_spread(values: Sequence[float]) -> dict[str, float]:
    """Median, minimum and maximum of repeated measurements (what the READMEs report as
    ``median (min-max)``)."""
    if not values:
        raise ValueError("no repetitions to summarise")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }
