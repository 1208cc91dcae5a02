"""Quantiles and SLO attainment from cumulative Prometheus histogram buckets."""

from __future__ import annotations

import math

from pdserve.planner.snapshot import LatencyStats

Buckets = list[tuple[float, float]]  # (upper bound "le", cumulative count), sorted by bound


def delta(cur: Buckets, prev: Buckets) -> Buckets:
    """Per-bucket increase between two scrapes; a counter reset restarts from ``cur``."""
    before = dict(prev)
    out = [(le, n - before.get(le, 0.0)) for le, n in cur]
    if any(n < 0 for _, n in out):
        return list(cur)
    return out


def quantile(buckets: Buckets, q: float) -> float:
    """Like PromQL histogram_quantile: linear within the bucket holding rank q * count."""
    assert 0.0 <= q <= 1.0, q
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    rank = q * buckets[-1][1]
    lower_le, lower_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):  # in the +Inf bucket: the largest finite bound
                return lower_le
            if n == lower_n:
                return le
            return lower_le + (le - lower_le) * (rank - lower_n) / (n - lower_n)
        lower_le, lower_n = le, n
    return lower_le


def fraction_within(buckets: Buckets, target: float) -> float:
    """Share of observations <= target, interpolating linearly inside the bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return 1.0
    total = buckets[-1][1]
    lower_le, lower_n = 0.0, 0.0
    for le, n in buckets:
        if target <= le:
            if math.isinf(le):
                return lower_n / total
            share = (target - lower_le) / (le - lower_le) if le > lower_le else 1.0
            return (lower_n + (n - lower_n) * share) / total
        lower_le, lower_n = le, n
    return 1.0


def stats(buckets: Buckets, count: float, total_s: float, target: float) -> LatencyStats:
    """LatencyStats for one interval from bucket increases, count and sum increases."""
    if count <= 0:
        return LatencyStats()
    return LatencyStats(
        count=round(count),
        mean=total_s / count,
        p50=quantile(buckets, 0.5),
        p90=quantile(buckets, 0.9),
        p99=quantile(buckets, 0.99),
        attainment=fraction_within(buckets, target),
    )
