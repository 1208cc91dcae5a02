"""The tiers' Prometheus metrics, read from the store's counters at scrape time (the engine
core's registry, worker/metrics.py ``CoreMetrics``):

- ``pdserve_kv_tier_hits{tier}``: blocks loaded back from each tier;
- ``pdserve_kv_tier_misses``, ``pdserve_kv_tier_bad_entries``, ``pdserve_kv_tier_errors{tier}``,
  ``pdserve_kv_tier_dropped_writes``, ``pdserve_kv_tier_load_timeouts``;
- ``pdserve_kv_tier_bytes{tier, direction}``: bytes read from / written to each tier;
- ``pdserve_kv_tier_load_seconds``: one request's load from the tiers (histogram).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.kv_tiers.stats import LOAD_BUCKETS, TierStats


class TierCollector(Collector):
    def __init__(self, stats: TierStats, role: str) -> None:
        self.stats = stats
        self.role = role

    def collect(self) -> Iterable[Metric]:
        s, role = self.stats, self.role
        per_tier = {
            "pdserve_kv_tier_hits": ("KV blocks loaded back from a tier", s.hits),
            "pdserve_kv_tier_blocks_written": (
                "KV blocks written down to a tier",
                s.blocks_written,
            ),
            "pdserve_kv_tier_errors": ("tier reads or writes that failed", s.errors),
        }
        for name, (doc, values) in per_tier.items():
            c = CounterMetricFamily(name, doc, labels=["role", "tier"])
            for tier, value in values.items():
                c.add_metric([role, tier], value)
            yield c
        moved = CounterMetricFamily(
            "pdserve_kv_tier_bytes",
            "KV bytes moved to and from a tier",
            labels=["role", "tier", "direction"],
        )
        for tier in s.tiers:
            moved.add_metric([role, tier, "read"], s.bytes_read[tier])
            moved.add_metric([role, tier, "written"], s.bytes_written[tier])
        yield moved
        plain = {
            "pdserve_kv_tier_misses": ("blocks a tier load found in no tier", s.misses),
            "pdserve_kv_tier_bad_entries": (
                "tier entries that failed verification",
                s.bad_entries,
            ),
            "pdserve_kv_tier_dropped_writes": (
                "evicted blocks not written (queue full)",
                s.dropped_writes,
            ),
            "pdserve_kv_tier_load_timeouts": (
                "tier loads cut off at their deadline",
                s.load_timeouts,
            ),
        }
        for name, (doc, value) in plain.items():
            c = CounterMetricFamily(name, doc, labels=["role"])
            c.add_metric([role], value)
            yield c
        h = HistogramMetricFamily(
            "pdserve_kv_tier_load_seconds",
            "time of one request's load from the KV tiers",
            labels=["role"],
        )
        cumulative, buckets = 0, []
        for bound, count in zip((*LOAD_BUCKETS, float("inf")), s.load_buckets, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        h.add_metric([role], buckets, s.load_seconds_sum)
        yield h
