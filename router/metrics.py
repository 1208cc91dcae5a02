"""Router metrics (names are contracts: see docs/architecture.md).

Each router app owns its own registry so that several apps (tests) can live in
one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)

from pdserve.router import fast_metrics as fast

disable_created_metrics()  # no *_created series: they double every counter on scrape

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RouterMetrics:
    """The router's series. Those updated per request are ``fast_metrics``' (lock-free,
    event loop only); the rest are prometheus_client's."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

        def latency(name: str, doc: str) -> fast.Histogram:
            return fast.Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = latency("pdserve_router_ttft_seconds", "Time to first token")
        self.tpot = latency(
            "pdserve_router_tpot_seconds", "Mean time per output token after the first, per request"
        )
        self.itl = latency("pdserve_router_itl_seconds", "Inter-token latency")
        self.e2e = latency("pdserve_router_e2e_seconds", "Request latency")
        self.requests = fast.Counter(
            "pdserve_router_requests", "Requests by HTTP status code", ["code"], registry=r
        )
        self.decisions = fast.Counter(
            "pdserve_router_routing_decisions",
            "Routing decisions by kind",
            ["kind"],
            registry=r,
        )
        self.prefix_match = fast.Histogram(
            "pdserve_router_prefix_match_ratio",
            "Share of the prompt cached on the chosen prefill worker",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.lora_routed = Counter(
            "pdserve_router_lora_routed",
            "Requests naming a LoRA adapter, by pool and whether the picked worker listed "
            "the adapter resident (lora-affinity's hit)",
            ["role", "resident"],
            registry=r,
        )
        self.inflight = fast.Gauge(
            "pdserve_router_inflight_requests",
            "Requests in flight per worker",
            ["worker", "role"],
            registry=r,
        )
        self.queue_depth = fast.Gauge(
            "pdserve_router_queue_depth", "Requests admitted and not finished", registry=r
        )
        # what the planner sizes the prefill pool for (queue_depth also counts decoding ones)
        self.prefill_queue_depth = fast.Gauge(
            "pdserve_router_prefill_queue_depth",
            "Requests dispatched whose first token has not come back (waiting for or in prefill)",
            registry=r,
        )
        self.prompt_tokens = fast.Counter(
            "pdserve_router_prompt_tokens", "Prompt tokens routed", registry=r
        )
        self.generation_tokens = fast.Counter(
            "pdserve_router_generation_tokens", "Tokens generated", registry=r
        )

        # every worker call that failed as the worker's fault (then retried, migrated or
        # failed); a planned scale-down must add none (tests/local/test_scale_under_load.py)
        self.worker_failures = Counter(
            "pdserve_router_worker_failures",
            "Calls to a worker that failed (connection, timeout, 5xx, broken stream)",
            ["role"],
            registry=r,
        )
        self.migrated = Counter(
            "pdserve_router_migrated_streams",
            "Requests moved to another decode worker after theirs died mid-stream",
            registry=r,
        )
        self.stalled = Counter(
            "pdserve_router_stalled_streams",
            "Calls to a worker (decode streams, prefills) cut because the worker went quiet "
            "and failed its health check",
            ["role"],
            registry=r,
        )
        # tenants (docs/router.md "Limits and isolation")
        self.slow_readers = Counter(
            "pdserve_router_slow_reader_aborts",
            "Streams aborted because their client stopped reading (--stream-write-timeout)",
            registry=r,
        )

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: prometheus_client checks and joins the labels
        on every call, a few µs each, several calls per request (no series is ever
        removed, so a kept child stays the one the registry renders)."""
        key = (id(metric), values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*values)
        return got

    def watch_index(self, size: Callable[[], float], evicted: Callable[[], float]) -> None:
        """The prefix index's size and evictions, read when /metrics is scraped."""
        Gauge(
            "pdserve_router_prefix_index_blocks",
            "Block hashes the prefix index holds (bounded by --prefix-index-max-blocks)",
            registry=self.registry,
        ).set_function(size)
        Gauge(
            "pdserve_router_prefix_index_evicted_blocks",
            "Block hashes the prefix index forgot for its bound, since start",
            registry=self.registry,
        ).set_function(evicted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
