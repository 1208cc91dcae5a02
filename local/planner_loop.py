"""The local-mode autoscaler loop behind ``pdserve up --autoscale``.

Every interval: scrape the router's /metrics, build a snapshot against the
previous scrape, run the planner, and call ``scale_prefill(n)`` /
``scale_decode(n)`` (provided by the local mode, which starts or stops worker
processes) when a pool's desired count changes. A failed scrape or callback is
logged and the loop goes on; it never takes ``pdserve up`` down.

Usage from the local mode::

    autoscaler = LocalAutoscaler(
        config_from_args(args),
        fetch_metrics=http_fetcher("http://127.0.0.1:8000/metrics"),
        pool_status=lambda: (PoolStatus(n_prefill, ready_prefill), PoolStatus(...)),
        scale_prefill=start_or_stop_prefill_workers,  # async or plain, takes the new count
        scale_decode=start_or_stop_decode_workers,
        interval_s=args.autoscale_interval,
    )
    task = asyncio.create_task(autoscaler.run(stop_event))
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace

import httpx

from pdserve.planner.capacity import load_profile
from pdserve.planner.config import SLO, Bounds, PlannerConfig, Stability
from pdserve.planner.decision import Decision, PlannerState
from pdserve.planner.metrics import MetricsError, Scrape, parse_text, snapshot_from_scrapes
from pdserve.planner.plan import plan
from pdserve.planner.presets import PRESETS
from pdserve.planner.snapshot import PoolStatus

log = logging.getLogger(__name__)

ScaleFn = Callable[[int], "Awaitable[object] | object"]
FetchFn = Callable[[], Awaitable[str]]
PoolsFn = Callable[[], tuple[PoolStatus, PoolStatus]]


class LocalAutoscaler:
    def __init__(
        self,
        config: PlannerConfig,
        *,
        fetch_metrics: FetchFn,
        pool_status: PoolsFn,
        scale_prefill: ScaleFn,
        scale_decode: ScaleFn,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        startup_s: Callable[[], float] | None = None,
    ) -> None:
        assert interval_s > 0, interval_s
        self.config = config
        self.state = PlannerState()
        self.interval_s = interval_s
        self.decisions: deque[Decision] = deque(maxlen=100)  # newest last, for /status and tests
        self._fetch, self._pools, self._clock = fetch_metrics, pool_status, clock
        self._scale = {"prefill": scale_prefill, "decode": scale_decode}
        self._prev: Scrape | None = None
        # the start-up measured so far (local/autoscale.py times every worker it starts);
        # None: the configured startup_s
        self._startup_s = startup_s

    async def step(self) -> Decision | None:
        """One interval: scrape, plan, scale. Returns the decision (None on the first scrape)."""
        try:
            scrape = parse_text(await self._fetch(), self._clock())
        except (MetricsError, httpx.HTTPError, OSError) as exc:
            log.warning("autoscaler: scrape failed, skipping this interval: %s", exc)
            return None
        prev, self._prev = self._prev, scrape
        if prev is None:
            return None
        prefill, decode = self._pools()
        snap = snapshot_from_scrapes(prev, scrape, prefill, decode, self.config.slo)
        config = self.config
        if self._startup_s is not None:
            config = replace(config, startup_s=self._startup_s())
        decision, self.state = plan(snap, self.state, config)
        if not self.decisions or self.decisions[-1].mode != decision.mode:
            # the P:D split in force: colocated runs no prefill worker (needs --prefill-min 0)
            print(f"pdserve up: autoscaler: mix {decision.mode}: {decision.mix_reason}", flush=True)
        self.decisions.append(decision)
        for pool in (decision.prefill, decision.decode):
            if pool.changed:  # why a worker starts or stops, beside the pools' own lines
                print(
                    f"pdserve up: autoscaler: {pool.role} {pool.current} -> {pool.desired}: "
                    f"{pool.reason}",
                    flush=True,
                )
                await self._call(pool.role, pool.desired)
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        """Step every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            await self.step()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)

    async def _call(self, role: str, n: int) -> None:
        try:
            result = self._scale[role](n)
            if inspect.isawaitable(result):
                await result
        except Exception:  # a failed scale action must not stop the loop
            log.exception("autoscaler: scale_%s(%d) failed", role, n)


def http_fetcher(url: str, timeout_s: float = 5.0, api_key: str = "") -> FetchFn:
    """A fetch function for ``LocalAutoscaler`` that GETs Prometheus text from ``url``
    (with ``api_key``: the router's /metrics needs an admin key while keys are on)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def fetch() -> str:
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
            reply = await client.get(url)
            reply.raise_for_status()
            return reply.text

    return fetch


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for ``pdserve up --autoscale`` (local/up_args.py)."""
    from pdserve.config_cli import add_flags
    from pdserve.local.up_args import AutoscaleArgs

    add_flags(parser, (AutoscaleArgs,))


def config_from_args(args: argparse.Namespace) -> PlannerConfig:
    profile = PRESETS.get(args.profile) or load_profile(args.profile)
    window = args.scale_down_window
    return PlannerConfig(
        slo=SLO(args.slo_ttft_ms / 1000.0, args.slo_tpot_ms / 1000.0, args.slo_target_attainment),
        profile=profile,
        prefill=Bounds(args.prefill_min, args.prefill_max),
        decode=Bounds(args.decode_min, args.decode_max),
        stability=replace(
            Stability(),
            scale_down_window_s=window,
            scale_down_cooldown_s=window / 2,
            unready_hold_s=args.unready_hold,
        ),
        min_requests_for_correction=5,
        startup_s=args.worker_startup,
    )
