"""Speculative decoding's Prometheus metrics, read from the engine at scrape time.

Counters of verifications, draft tokens, accepted drafts and emitted tokens, and two
gauges derived from them since start: the acceptance rate (accepted / drafted) and the
tokens a verification emits per step (emitted / verifications; 1.0 is no gain).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.engine.spec_decode import SpecStats
from pdserve.worker.metrics import role_families


class SpecCollector(Collector):
    def __init__(self, stats: SpecStats, role: str) -> None:
        self.stats = stats
        self.role = role

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        counters = {
            "pdserve_spec_decode_steps": ("speculative verifications, per request", s.steps),
            "pdserve_spec_decode_draft_tokens": ("draft tokens proposed", s.draft_tokens),
            "pdserve_spec_decode_accepted_tokens": ("draft tokens accepted", s.accepted_tokens),
            "pdserve_spec_decode_emitted_tokens": (
                "tokens emitted by speculative steps",
                s.emitted_tokens,
            ),
        }
        yield from role_families(CounterMetricFamily, self.role, counters)
        gauges = {
            "pdserve_spec_decode_acceptance_rate": (
                "accepted / proposed draft tokens since start",
                s.accepted_tokens / s.draft_tokens if s.draft_tokens else 0.0,
            ),
            "pdserve_spec_decode_tokens_per_step": (
                "tokens emitted per speculative step since start",
                s.emitted_tokens / s.steps if s.steps else 0.0,
            ),
        }
        yield from role_families(GaugeMetricFamily, self.role, gauges)
