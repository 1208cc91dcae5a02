"""Prometheus metrics of a worker (names are contracts: docs/architecture.md).

A worker is two processes (worker/core/client.py), and each records what happens in
it: the front end (:class:`WorkerMetrics`) the engine's gauges and counters, read from
the latest stats snapshot the core sent at scrape time, and requests by outcome and
queue wait; the engine core (:class:`CoreMetrics`) KV transfers and lease expiries. The
families are disjoint, so ``/metrics`` is the two renders one after the other. Each
has its own registry, so tests can run several in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.protocol.contract import EngineStats

disable_created_metrics()  # no *_created series: they double every counter on scrape

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class StatsSource(Protocol):
    def stats(self) -> EngineStats: ...


def role_families(
    kind: type[CounterMetricFamily | GaugeMetricFamily],
    role: str,
    table: Mapping[str, tuple[str, float]],
) -> Iterator[Metric]:
    """A family per entry of ``table`` (name: (doc, value)), its one series the role's."""
    for name, (doc, value) in table.items():
        family = kind(name, doc, labels=["role"])
        family.add_metric([role], value)
        yield family


class _EngineCollector(Collector):
    def __init__(self, engine: StatsSource, role: str) -> None:
        self.engine = engine
        self.role = role

    def collect(self) -> Iterable[Metric]:
        s = self.engine.stats()
        gauges = {
            "pdserve_kv_blocks_total": ("KV blocks in the pool", s.kv_blocks_total),
            "pdserve_kv_blocks_free": ("KV blocks free (incl. cached, unowned)", s.kv_blocks_free),
            "pdserve_num_requests_running": ("requests in the running batch", s.running),
            "pdserve_num_requests_waiting": (
                "requests waiting (incl. for KV)",
                s.waiting + s.loading,
            ),
            "pdserve_kv_leases_held": ("requests whose KV is held under a lease", s.held),
            "pdserve_queued_prompt_tokens": (
                "prompt tokens not yet computed",
                s.queued_prompt_tokens,
            ),
        }
        yield from role_families(GaugeMetricFamily, self.role, gauges)
        counters = {
            "pdserve_prefix_cache_hit_tokens": (
                "prompt tokens served from the prefix cache",
                s.prefix_cache_hit_tokens,
            ),
            "pdserve_prompt_tokens": ("prompt tokens received", s.prompt_tokens),
            "pdserve_generation_tokens": ("tokens generated", s.generation_tokens),
            "pdserve_preemptions": ("requests preempted for recompute", s.preemptions),
            "pdserve_engine_step_failures": ("engine steps that raised", s.step_failures),
        }
        yield from role_families(CounterMetricFamily, self.role, counters)
        yield from _compile_and_fault(s, self.role)


COMPILE_STATES = ("off", "compiling", "ready", "compiled", "eager-kept")  # compile_job.py


def _compile_and_fault(s: EngineStats, role: str) -> Iterable[Metric]:
    """The forward's compile state (1 on the current one) and whether the engine is
    faulted (a step raised and its probe has not passed since: engine/step_fault.py)."""
    g = GaugeMetricFamily(
        "pdserve_engine_compile_state",
        "the forward in service: 1 on the current compile state "
        "(off, compiling, ready, compiled, eager-kept)",
        labels=["role", "state"],
    )
    for state in COMPILE_STATES:
        g.add_metric([role, state], float(s.compile == state))
    yield g
    f = GaugeMetricFamily(
        "pdserve_engine_faulted",
        "1 while a step failure stands (the worker is unready)",
        labels=["role"],
    )
    f.add_metric([role], float(bool(s.fault)))
    yield f


def _histogram(name: str, doc: str, labels: list[str], r: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=r)


class WorkerMetrics:
    """The front end's metrics (the HTTP process)."""

    def __init__(self, engine: StatsSource, role: str) -> None:
        self.role = role
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine, role))
        self.queue_wait = _histogram(
            "pdserve_prefill_queue_wait_seconds", "time from arrival to first schedule", ["role"], r
        )
        self.requests = Counter(
            "pdserve_worker_requests", "requests by outcome", ["role", "outcome"], registry=r
        )
        # decode, --pd-handoff decode (decode_worker/chain.py): ok, failed (moved to the
        # next prefill worker), local (every prefill worker failed: prefilled here)
        self.prefill_calls = Counter(
            "pdserve_worker_prefill_calls",
            "prefill calls this worker made, by outcome",
            ["role", "outcome"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CoreMetrics:
    """The engine core's metrics (its process): KV transfers and leases."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = r = CollectorRegistry()
        transfer = ["role", "transport"]
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes moved between workers", transfer, registry=r
        )
        self.transfer_seconds = _histogram(
            "pdserve_kv_transfer_seconds", "time of one request's KV transfer", transfer, r
        )
        self.transfer_failures = Counter(
            "pdserve_kv_transfer_failures", "KV transfers that failed", transfer, registry=r
        )
        self.lease_expired = Counter(
            "pdserve_kv_lease_expired",
            "KV leases that expired before release",
            ["role"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
