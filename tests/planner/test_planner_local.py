"""The local-mode autoscaler loop, with fake pools and scale callbacks.

The router and worker processes belong to ``pdserve up`` (local/up.py);
here the metrics come from real prometheus_client metrics under the contract
names, served over loopback HTTP in the last test, and the "pools" are counters
that the scale callbacks move.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
from planner_helpers import FakeRouter
from prometheus_client import start_http_server

from pdserve.local.planner_loop import (
    LocalAutoscaler,
    add_autoscale_arguments,
    config_from_args,
    http_fetcher,
)
from pdserve.planner.snapshot import PoolStatus

pytestmark = pytest.mark.unit


class FakePools:
    """Worker counts that become ready after ``startup`` steps; records every scale call."""

    def __init__(self) -> None:
        self.count = {"prefill": 1, "decode": 1}
        self.ready = {"prefill": 1, "decode": 1}
        self.calls: list[tuple[str, int]] = []

    def status(self) -> tuple[PoolStatus, PoolStatus]:
        return (
            PoolStatus(self.count["prefill"], self.ready["prefill"]),
            PoolStatus(self.count["decode"], self.ready["decode"]),
        )

    def scaler(self, role: str):
        async def scale(n: int) -> None:
            self.calls.append((role, n))
            self.count[role] = n

        return scale

    def start_all(self) -> None:
        self.ready = dict(self.count)


def make_config(*flags: str):
    parser = argparse.ArgumentParser()
    add_autoscale_arguments(parser)
    return config_from_args(parser.parse_args(list(flags)))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fake_autoscaler(
    *flags: str,
) -> tuple[LocalAutoscaler, FakeRouter, FakePools, Clock]:
    """An autoscaler over a fake router and pools, on a clock the test moves."""
    router, pools, clock = FakeRouter(), FakePools(), Clock()

    async def fetch() -> str:
        return router.text()

    auto = LocalAutoscaler(
        make_config(*flags),
        fetch_metrics=fetch,
        pool_status=pools.status,
        scale_prefill=pools.scaler("prefill"),
        scale_decode=pools.scaler("decode"),
        interval_s=5.0,
        clock=clock,
    )
    return auto, router, pools, clock


async def test_ttft_breach_scales_prefill_then_quiet_scales_back(capsys) -> None:
    auto, router, pools, clock = fake_autoscaler(
        "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200", "--scale-down-window", "30"
    )
    assert await auto.step() is None  # first scrape: nothing to compare with
    assert pools.calls == []
    # 10 s of 6 req/s with 2000-token prompts: 12k prompt tok/s >> one CPU prefill worker
    clock.t = 10.0
    router.serve_interval(60, ttft=4.0, tpot=0.05, prompt=2000, output=20)
    router.depth.set(40)
    decision = await auto.step()
    assert decision is not None and decision.prefill.desired == 4  # max of --prefill-max 4
    assert ("prefill", 4) in pools.calls
    assert "prompt tokens forecast queued" in decision.prefill.reason
    # every scale decision is printed with its reason, beside the pools' start/stop lines
    assert f"pdserve up: autoscaler: prefill 1 -> 4: {decision.prefill.reason}" in (
        capsys.readouterr().out
    )
    pools.start_all()
    # quiet: after the window the prefill pool shrinks, one step at a time
    router.depth.set(0)
    for i in range(2, 20):
        clock.t = 10.0 * i
        router.serve_interval(2, ttft=0.2, tpot=0.05, prompt=100, output=20)
        await auto.step()
        pools.start_all()
    assert pools.count["prefill"] == 1
    assert [n for role, n in pools.calls if role == "prefill"] == [4, 2, 1]
    assert len(auto.decisions) == 19


async def test_scrape_and_callback_failures_do_not_stop_the_loop() -> None:
    router, pools, clock = FakeRouter(), FakePools(), Clock()
    fail_next = [True]

    async def fetch() -> str:
        if fail_next[0]:
            fail_next[0] = False
            raise OSError("connection refused")
        return router.text()

    def broken_scale(n: int) -> None:
        raise RuntimeError("cannot start worker")

    auto = LocalAutoscaler(
        make_config("--slo-ttft-ms", "1000"),
        fetch_metrics=fetch,
        pool_status=pools.status,
        scale_prefill=broken_scale,
        scale_decode=pools.scaler("decode"),
        clock=clock,
    )
    assert await auto.step() is None  # failed scrape
    clock.t = 5.0
    assert await auto.step() is None  # first good scrape
    clock.t = 15.0
    router.serve_interval(60, ttft=4.0, tpot=0.05, prompt=2000, output=20)
    decision = await auto.step()
    assert decision is not None and decision.prefill.desired > 1  # decided, callback raised


@pytest.mark.timeout(30)
async def test_run_loop_over_loopback_http() -> None:
    router, pools = FakeRouter(), FakePools()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=router.reg)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        auto = LocalAutoscaler(
            make_config("--slo-ttft-ms", "1000"),
            fetch_metrics=http_fetcher(url),
            pool_status=pools.status,
            scale_prefill=pools.scaler("prefill"),
            scale_decode=pools.scaler("decode"),
            interval_s=0.2,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(auto.run(stop))
        for _ in range(50):
            router.serve_interval(20, ttft=4.0, tpot=0.05, prompt=2000, output=20)
            await asyncio.sleep(0.05)
            if pools.calls:
                break
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        assert pools.calls and pools.calls[0][0] == "prefill" and pools.calls[0][1] > 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


async def test_short_prompts_run_colocated_when_the_prefill_pool_may_be_empty(capsys) -> None:
    """--prefill-min 0: short prompts with a loose TPOT stop the prefill workers (the router
    prefills on decode workers when it has none); the mix and why are printed."""
    flags = (
        "--prefill-min",
        "0",
        "--slo-ttft-ms",
        "3000",
        "--slo-tpot-ms",
        "500",
        "--scale-down-window",
        "5",
    )
    auto, router, pools, clock = fake_autoscaler(*flags)
    assert await auto.step() is None  # first scrape: nothing to compare with
    assert pools.calls == []
    for i in range(1, 6):
        clock.t = 10.0 * i
        router.serve_interval(10, ttft=0.1, tpot=0.02, prompt=16, output=64)
        decision = await auto.step()
    assert decision is not None and decision.mode == "colocated", decision.mix_reason
    assert ("prefill", 0) in pools.calls and pools.count["prefill"] == 0
    assert pools.count["decode"] >= 1
    assert "pdserve up: autoscaler: mix colocated" in capsys.readouterr().out
