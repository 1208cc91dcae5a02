"""Shared builders for planner tests."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.planner.config import SLO, Bounds, PlannerConfig
from pdserve.planner.decision import PlannerState, PoolMemory
from pdserve.planner.presets import H100_LLAMA3_8B
from pdserve.planner.snapshot import LatencyStats, MetricsSnapshot, PoolStatus

T0 = 10_000.0


def config(**kw) -> PlannerConfig:
    base = PlannerConfig(
        slo=SLO(ttft_s=1.0, tpot_s=0.05),
        profile=H100_LLAMA3_8B,
        prefill=Bounds(1, 100),
        decode=Bounds(1, 100),
    )
    return replace(base, **kw)


def snap(
    t: float = T0,
    prefill: tuple[int, int, int] = (10, 10, 0),
    decode: tuple[int, int, int] = (10, 10, 0),
    rps: float = 100.0,
    prompt: float = 1000.0,
    output: float = 200.0,
    **kw,
) -> MetricsSnapshot:
    """A snapshot at ``rps`` requests/s of ``prompt`` prompt and ``output`` output tokens.

    By default the decode pool runs 2400 sequences: 9.4 replicas' worth at 256 each.
    """
    kw.setdefault("decode_running", 2400.0)
    return MetricsSnapshot(
        time_s=t,
        interval_s=10.0,
        prefill=PoolStatus(*prefill),
        decode=PoolStatus(*decode),
        request_rate=rps,
        prompt_token_rate=rps * prompt,
        output_token_rate=rps * output,
        **kw,
    )


def settled(prefill: int = 10, decode: int = 10, t: float = T0) -> PlannerState:
    """State of a planner that set these counts long ago (no cooldown, empty window)."""
    old = t - 100_000.0
    return PlannerState(
        prefill=PoolMemory(last_target=prefill, last_scale_s=old),
        decode=PoolMemory(last_target=decode, last_scale_s=old),
    )


def lat(mean: float, count: int = 100) -> LatencyStats:
    return LatencyStats(count=count, mean=mean, p50=mean, p90=mean * 1.5, p99=mean * 2)


BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FakeRouter:
    """Real prometheus_client metrics under the contract names (router + two workers)."""

    def __init__(self) -> None:
        self.reg = CollectorRegistry()
        r = self.reg
        self.ttft = Histogram("pdserve_router_ttft_seconds", "", buckets=BUCKETS, registry=r)
        self.tpot = Histogram("pdserve_router_tpot_seconds", "", buckets=BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_itl_seconds", "", buckets=BUCKETS, registry=r)
        self.requests = Counter("pdserve_router_requests", "", ["code"], registry=r)
        self.prompt = Counter("pdserve_router_prompt_tokens", "", registry=r)
        self.output = Counter("pdserve_router_generation_tokens", "", registry=r)
        self.depth = Gauge("pdserve_router_prefill_queue_depth", "", registry=r)
        self.wait = Histogram(
            "pdserve_prefill_queue_wait_seconds", "", ["role"], buckets=BUCKETS, registry=r
        )
        self.running = Gauge("pdserve_num_requests_running", "", ["role"], registry=r)
        self.kv_total = Gauge("pdserve_kv_blocks_total", "", ["role"], registry=r)
        self.kv_free = Gauge("pdserve_kv_blocks_free", "", ["role"], registry=r)
        self.hits = Counter("pdserve_prefix_cache_hit_tokens", "", ["role"], registry=r)

    def text(self) -> str:
        return generate_latest(self.reg).decode()

    def serve_interval(self, n: int, ttft: float, tpot: float, prompt: int, output: int) -> None:
        """Record ``n`` finished requests of the given latencies and lengths."""
        for _ in range(n):
            self.ttft.observe(ttft)
            self.tpot.observe(tpot)
            self.requests.labels("200").inc()
            self.prompt.inc(prompt)
            self.output.inc(output)
