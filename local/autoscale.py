"""``pdserve up --autoscale``: the planner adds and removes local worker processes.

``LocalAutoscaling`` joins three loops until stopped: the planner
(``pdserve.local.planner_loop.LocalAutoscaler``, scraping the router's /metrics), a
health poll that tells the planner which workers are ready, and a watch that
ends everything when a worker dies on its own. Scaling goes through
``LocalCluster.add_worker`` / ``remove_worker``; the router learns the new worker
list from the workers file it re-reads (``router/discovery/file.py``). A worker is
stopped only once the router no longer lists it and it owes no request
(``local/drain.py``): a planned scale-down costs no client anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import httpx

from pdserve.local.drain import Listed, router_lists
from pdserve.local.planner_loop import LocalAutoscaler, config_from_args, http_fetcher
from pdserve.local.processes import LocalCluster, Proc
from pdserve.local.supervise import Supervisor
from pdserve.planner.config import PlannerConfig
from pdserve.planner.snapshot import PoolStatus
from pdserve.planner.startup import StartupEstimate

ROLES = ("prefill", "decode")


class LocalPools:
    """Pool counts and scale actions over a LocalCluster's worker processes."""

    def __init__(
        self,
        cluster: LocalCluster,
        drain_timeout_s: float = 30.0,
        listed: Listed | None = None,
        startup: StartupEstimate | None = None,
    ) -> None:
        self.cluster = cluster
        self.drain_timeout_s = drain_timeout_s
        self.listed = listed  # whether the router still lists a URL (local/drain.py)
        self.ready: set[str] = set()  # names of workers answering /health
        self.startup = startup or StartupEstimate(0.0)  # learned: spawn -> first /health 200
        self._timed: dict[str, float] = {}  # worker name -> the spawn its start-up was timed from
        self.events: list[str] = []  # what was scaled, for the log and tests

    def workers(self, role: str) -> list[Proc]:
        return [p for p in self.cluster.procs if p.role == role]

    def status(self) -> tuple[PoolStatus, PoolStatus]:
        out = []
        for role in ROLES:
            procs = self.workers(role)
            out.append(PoolStatus(len(procs), sum(p.name in self.ready for p in procs)))
        return out[0], out[1]

    async def scale(self, role: str, n: int) -> None:
        while len(self.workers(role)) < n:
            proc = self.cluster.add_worker(role)
            self._say(f"{role}: started {proc.name} at {proc.url}")
        while len(self.workers(role)) > n:
            victim = self._victim(role)
            self._say(f"{role}: draining and stopping {victim.name}")
            if victim.spawned_at and self._timed.get(victim.name) != victim.spawned_at:
                # stopped before it was ever ready: its age is a lower bound of the start-up
                self.startup.stopped_unready(role, time.monotonic() - victim.spawned_at)
            self.ready.discard(victim.name)
            drained = await asyncio.to_thread(
                self.cluster.remove_worker, victim, self.drain_timeout_s, self.listed
            )
            if not drained:
                self._say(f"{victim.name} not drained in {self.drain_timeout_s:g}s; stopped anyway")

    def _victim(self, role: str) -> Proc:
        """The newest unready worker if any (it serves nothing yet), else the newest."""
        procs = self.workers(role)
        unready = [p for p in procs if p.name not in self.ready]
        return (unready or procs)[-1]

    async def poll_health(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while not stop.is_set():
                for proc in [p for role in ROLES for p in self.workers(role)]:
                    try:
                        ok = (await client.get(proc.url + "/health")).status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if ok and proc.name not in self.ready:
                        self._say(f"{proc.name} ready{self._timing(proc)}")
                    (self.ready.add if ok else self.ready.discard)(proc.name)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=interval_s)

    def _timing(self, proc: Proc) -> str:
        """Its first ready after a spawn is one start-up observed (a restart spawns anew)."""
        if not proc.spawned_at or self._timed.get(proc.name) == proc.spawned_at:
            return ""  # not spawned by us, or ready again after a failed poll
        self._timed[proc.name] = proc.spawned_at
        took = time.monotonic() - proc.spawned_at
        self.startup.observe(proc.role, took)
        return f" after {took:.1f}s ({self.startup.describe()})"

    def _say(self, message: str) -> None:
        self.events.append(message)
        print(f"pdserve up: autoscaler: {message}", flush=True)


class LocalAutoscaling:
    def __init__(
        self,
        cluster: LocalCluster,
        router_url: str,
        config: PlannerConfig,
        interval_s: float,
        api_key: str = "",
    ) -> None:
        # the planner's start-up: --worker-startup until the pools have timed their workers
        startup = StartupEstimate(config.startup_s)
        self.pools = LocalPools(cluster, listed=router_lists(router_url, api_key), startup=startup)
        self.autoscaler = LocalAutoscaler(
            config,
            fetch_metrics=http_fetcher(router_url + "/metrics", api_key=api_key),
            pool_status=self.pools.status,
            scale_prefill=lambda n: self.pools.scale("prefill", n),
            scale_decode=lambda n: self.pools.scale("decode", n),
            interval_s=interval_s,
            startup_s=startup.planner_startup_s,
        )

    async def run(self, stop: asyncio.Event) -> int:
        """Until ``stop`` is set; a process that dies is restarted (local/supervise.py)."""
        tasks = [
            asyncio.create_task(self.autoscaler.run(stop)),
            asyncio.create_task(self.pools.poll_health(stop)),
        ]
        code = 0
        supervisor = Supervisor(self.pools.cluster)
        try:
            while not stop.is_set():
                supervisor.tick()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.5)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return code


def run_autoscaled(cluster: LocalCluster, router: Proc, args: argparse.Namespace) -> int:
    """``pdserve up --autoscale`` after start-up: plan and scale until Ctrl-C."""
    config = config_from_args(args)
    scaling = LocalAutoscaling(
        cluster, router.url, config, args.autoscale_interval, api_key=args.api_key
    )
    print(f"pdserve up: autoscaling every {args.autoscale_interval:g}s (SLO TTFT "
          f"{args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms; prefill "
          f"{args.prefill_min}-{args.prefill_max}, decode {args.decode_min}-{args.decode_max})",
          flush=True)  # fmt: skip
    return asyncio.run(scaling.run(asyncio.Event()))
