"""A figure over repetitions, as the benchmarks report it: the median and [min, max]."""

from __future__ import annotations

import statistics
from typing import Any


def spread(values: list[float], digits: int = 3) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), digits),
        "range": [round(min(values), digits), round(max(values), digits)],
    }
