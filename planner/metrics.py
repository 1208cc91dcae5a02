"""Build planner snapshots from two scrapes of Prometheus text (router and workers).

Counters become rates and histograms become interval distributions by taking the
difference between two scrapes, the way PromQL's ``rate`` and
``histogram_quantile`` do. Metric names are the contract in docs/architecture.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdserve.planner import histogram
from pdserve.planner.config import SLO
from pdserve.planner.snapshot import LatencyStats, MetricsSnapshot, PoolStatus

ROUTER_TTFT = "pdserve_router_ttft_seconds"
ROUTER_TPOT = "pdserve_router_tpot_seconds"
ROUTER_ITL = "pdserve_router_itl_seconds"
ROUTER_REQUESTS = "pdserve_router_requests_total"
ROUTER_PROMPT_TOKENS = "pdserve_router_prompt_tokens_total"
ROUTER_OUTPUT_TOKENS = "pdserve_router_generation_tokens_total"
ROUTER_PREFILL_QUEUE = "pdserve_router_prefill_queue_depth"  # not yet past prefill
ROUTER_INFLIGHT = "pdserve_router_inflight_requests"
QUEUE_WAIT = "pdserve_prefill_queue_wait_seconds"
RUNNING = "pdserve_num_requests_running"
WAITING = "pdserve_num_requests_waiting"
KV_TOTAL = "pdserve_kv_blocks_total"
KV_FREE = "pdserve_kv_blocks_free"
CACHE_HITS = "pdserve_prefix_cache_hit_tokens_total"


class MetricsError(ValueError):
    """Metrics could not be read or parsed (bad text, bad reply, bad interval)."""


Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """Samples of one or more /metrics pages taken at ``time_s``: name -> [(labels, value)]."""

    time_s: float
    samples: dict[str, list[tuple[Labels, float]]]

    def total(self, name: str, **match: str) -> float | None:
        """Sum over the samples named ``name`` whose labels include ``match``; None if absent."""
        rows = self.samples.get(name)
        if rows is None:
            return None
        want = set(match.items())
        return sum(v for labels, v in rows if want <= set(labels))

    def buckets(self, name: str, **match: str) -> histogram.Buckets:
        """Cumulative buckets of histogram ``name`` summed over its other labels."""
        sums: dict[float, float] = defaultdict(float)
        want = set(match.items())
        for labels, v in self.samples.get(name + "_bucket", []):
            label_map = dict(labels)
            if want <= set(labels) and "le" in label_map:
                sums[float(label_map["le"])] += v
        return sorted(sums.items())


def parse_text(texts: str | list[str], time_s: float) -> Scrape:
    """Parse Prometheus text exposition (one page or several, e.g. router + workers)."""
    pages = [texts] if isinstance(texts, str) else texts
    samples: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    for page in pages:
        try:
            for family in text_string_to_metric_families(page):
                for s in family.samples:
                    samples[s.name].append((tuple(sorted(s.labels.items())), float(s.value)))
        except (ValueError, TypeError, IndexError) as exc:
            raise MetricsError(f"cannot parse Prometheus text: {exc}") from exc
    return Scrape(time_s, dict(samples))


def snapshot_from_scrapes(
    prev: Scrape, cur: Scrape, prefill: PoolStatus, decode: PoolStatus, slo: SLO
) -> MetricsSnapshot:
    """One interval's snapshot from two scrapes; pool counts come from the orchestrator."""
    dt = cur.time_s - prev.time_s
    if dt <= 0:
        raise MetricsError(f"scrapes must be in time order, got an interval of {dt}s")

    def rate(name: str, **match: str) -> float:
        return _increase(prev.total(name, **match), cur.total(name, **match)) / dt

    prompt_rate = rate(ROUTER_PROMPT_TOKENS)
    hits = rate(CACHE_HITS, role="prefill")
    return MetricsSnapshot(
        time_s=cur.time_s,
        interval_s=dt,
        prefill=prefill,
        decode=decode,
        ttft=_latency(prev, cur, ROUTER_TTFT, slo.ttft_s),
        tpot=_latency(prev, cur, ROUTER_TPOT, slo.tpot_s),
        itl=_latency(prev, cur, ROUTER_ITL, slo.tpot_s),
        request_rate=rate(ROUTER_REQUESTS),
        prompt_token_rate=prompt_rate,
        output_token_rate=rate(ROUTER_OUTPUT_TOKENS),
        cached_token_fraction=min(1.0, hits / prompt_rate) if prompt_rate > 0 else 0.0,
        prefill_queue_depth=prefill_queue(cur),
        prefill_queue_wait_s=_latency(prev, cur, QUEUE_WAIT, slo.ttft_s).mean,
        decode_running=_first(
            cur.total(RUNNING, role="decode"), cur.total(ROUTER_INFLIGHT, role="decode")
        ),
        decode_waiting=cur.total(WAITING, role="decode") or 0.0,
        kv_utilisation=_kv_utilisation(cur),
    )


def _latency(prev: Scrape, cur: Scrape, name: str, target: float) -> LatencyStats:
    count = _increase(prev.total(name + "_count"), cur.total(name + "_count"))
    total = _increase(prev.total(name + "_sum"), cur.total(name + "_sum"))
    buckets = histogram.delta(cur.buckets(name), prev.buckets(name))
    return histogram.stats(buckets, count, total, target)


def _increase(before: float | None, after: float | None) -> float:
    if after is None:
        return 0.0
    if before is None or after < before:  # new series or counter reset
        return after
    return after - before


def prefill_queue(cur: Scrape) -> float:
    """Requests waiting for or in prefill: the router's prefill-queue gauge (it counts a
    request until its first token, so also those queued on a worker); 0 before the
    router has exported it."""
    return cur.total(ROUTER_PREFILL_QUEUE) or 0.0


def _first(*values: float | None) -> float:
    return next((v for v in values if v is not None), 0.0)


def _kv_utilisation(cur: Scrape) -> float:
    total = cur.total(KV_TOTAL, role="decode")
    free = cur.total(KV_FREE, role="decode")
    if not total or free is None:
        return 0.0
    return max(0.0, min(1.0, 1.0 - free / total))
