"""``pdserve up --autoscale``: the planner adds and removes local worker processes.

``LocalAutoscaling`` joins three loops until stopped: the planner
(``pdserve.local.planner_loop.LocalAutoscaler``, scraping the router's /metrics), a
health poll that tells the planner which workers are ready, and a watch that
ends everything when a worker dies on its own. Scaling goes through
``LocalCluster.add_worker`` / ``remove_worker``; the router learns the new worker
list from the workers file it re-reads (``router/discovery/file.py``). A worker is
stopped only once the router no longer lists it and it owes no request
(``local/drain.py``): a planned scale-down costs no client anything.

Start-ups share the host's cores with the workers that serve: at most
``max_starting`` workers start at once (``--max-starting``). A pool's count is what
the planner ordered, as a Deployment's replicas: a worker past the cap is pending,
started when one still starting is ready, and the first to go on a scale-down. On 2
cores, three workers starting at once took both cores for 8 s while 20 req/s came
in, and TTFT p90 went from 0.1 s to 2.9 s (docs/autoscaling.md, 2026-12-04).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import httpx

from pdserve.local.drain import Listed, router_lists
from pdserve.local.planner_loop import LocalAutoscaler, config_from_args, http_fetcher
from pdserve.local.processes import LocalCluster, Proc, host_cores
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
        max_starting: int = 0,
    ) -> None:
        assert max_starting >= 0, max_starting
        self.cluster = cluster
        self.max_starting = max_starting  # workers starting at once; 0: no cap
        self.target: dict[str, int] = {}  # what the planner ordered, once it has
        self.drain_timeout_s = drain_timeout_s
        self.listed = listed  # whether the router still lists a URL (local/drain.py)
        self.ready: set[str] = set()  # names of workers answering /health
        self.startup = startup or StartupEstimate(0.0)  # learned: spawn -> first /health 200
        self._timed: dict[str, float] = {}  # worker name -> the spawn its start-up was timed from
        self.events: list[str] = []  # what was scaled, for the log and tests

    def workers(self, role: str) -> list[Proc]:
        return [p for p in self.cluster.procs if p.role == role]

    def ordered(self, role: str) -> int:
        """The pool's count: its workers, and those ordered but not started (pending)."""
        return max(self.target.get(role, 0), len(self.workers(role)))

    def status(self) -> tuple[PoolStatus, PoolStatus]:
        out = []
        for role in ROLES:
            procs = self.workers(role)
            out.append(PoolStatus(self.ordered(role), sum(p.name in self.ready for p in procs)))
        return out[0], out[1]

    def starting(self) -> int:
        """Workers not ready since their spawn, both roles (one that was ready and now
        fails its health check is not starting: a hung worker must not block the cap)."""
        return sum(
            p.name not in self.ready and self._timed.get(p.name) != p.spawned_at
            for role in ROLES
            for p in self.workers(role)
        )

    def start_pending(self) -> None:
        """Start pending workers while the cap has room: the pool furthest below its
        order first (prefill on a tie)."""
        while True:
            short = {r: self.target.get(r, 0) - len(self.workers(r)) for r in ROLES}
            role = max(ROLES, key=lambda r: short[r])
            if short[role] <= 0:
                return
            if self.max_starting and self.starting() >= self.max_starting:
                return
            proc = self.cluster.add_worker(role)
            self._say(f"{role}: started {proc.name} at {proc.url}")

    async def scale(self, role: str, n: int) -> None:
        self.target[role] = n
        if len(self.workers(role)) < n:
            self.start_pending()
            pending = n - len(self.workers(role))
            if pending:
                self._say(
                    f"{role}: {pending} pending: {self.starting()} worker(s) starting, "
                    f"--max-starting {self.max_starting}"
                )
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
                self.start_pending()  # a worker ready is room for a pending one
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
        max_starting: int = 0,
    ) -> None:
        # the planner's start-up: --worker-startup until the pools have timed their workers
        startup = StartupEstimate(config.startup_s)
        self.pools = LocalPools(
            cluster,
            listed=router_lists(router_url, api_key),
            startup=startup,
            max_starting=max_starting,
        )
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
    cap = max_starting(args)
    scaling = LocalAutoscaling(
        cluster, router.url, config, args.autoscale_interval, api_key=args.api_key, max_starting=cap
    )
    print(
        f"pdserve up: autoscaling every {args.autoscale_interval:g}s (SLO TTFT "
        f"{args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms; prefill "
        f"{args.prefill_min}-{args.prefill_max}, decode {args.decode_min}-{args.decode_max}; "
        f"at most {cap or 'any number of'} starting at once)",
        flush=True,
    )
    return asyncio.run(scaling.run(asyncio.Event()))


def max_starting(args: argparse.Namespace) -> int:
    """``--max-starting``, or its default on this host."""
    return default_max_starting() if args.max_starting is None else int(args.max_starting)


def default_max_starting() -> int:
    """One worker starting per 4 of the host's cores, at least 1."""
    return max(1, host_cores() // 4)
