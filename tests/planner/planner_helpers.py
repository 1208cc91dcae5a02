"""Shared builders for planner tests."""

from __future__ import annotations

from dataclasses import replace

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
