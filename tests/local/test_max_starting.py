"""``pdserve up --autoscale --max-starting``: at most that many workers start at once.

On 2 shared cores the real planner once started three workers together; their start-ups
took both cores for 8 s while 20 req/s arrived, and TTFT p90 went from ~0.1 s to 2.9 s
(docs/autoscaling.md). The pools now keep a worker past the cap pending, counted in its
pool (as a Deployment counts an unscheduled pod), started when one starting is ready,
and first to go on a scale-down. A fake cluster stands in for the processes (starting
real workers takes most of a minute here); one test polls a real loopback /health.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from pdserve.local import up
from pdserve.local.autoscale import LocalPools, max_starting
from pdserve.local.processes import Proc
from tests.aio_site import start_site

pytestmark = pytest.mark.unit


class _Cluster:
    """What LocalPools uses of a LocalCluster: the worker list, add and remove."""

    def __init__(self, tmp: Path, url: str = "http://127.0.0.1:9") -> None:
        self.tmp, self.url, self.procs = tmp, url, []  # type: list[Proc]
        self.started: list[str] = []
        for role in ("prefill", "decode"):
            self.add_worker(role)
        self.started.clear()

    def add_worker(self, role: str) -> Proc:
        name = f"{role}-{sum(p.role == role for p in self.procs)}"
        proc = Proc(name, role, f"{self.url}/{name}", [], self.tmp / f"{name}.log")
        self.procs.append(proc)
        self.started.append(name)
        return proc

    def remove_worker(self, proc: Proc, *_: object) -> bool:
        self.procs.remove(proc)
        return True


def _pools(tmp: Path, cap: int) -> tuple[LocalPools, _Cluster]:
    cluster = _Cluster(tmp)
    pools = LocalPools(cluster, max_starting=cap)  # type: ignore[arg-type]
    pools.ready |= {"prefill-0", "decode-0"}
    return pools, cluster


async def test_one_at_a_time_the_rest_pending_and_counted(tmp_path: Path) -> None:
    pools, cluster = _pools(tmp_path, cap=1)
    await pools.scale("prefill", 3)
    await pools.scale("decode", 2)
    assert cluster.started == ["prefill-1"]  # a broken cap starts all three
    # the planner sees what it ordered, not yet ready: it does not order them again
    prefill, decode = pools.status()
    assert (prefill.current, prefill.ready, decode.current, decode.ready) == (3, 1, 2, 1)
    assert any("1 pending" in e and "--max-starting 1" in e for e in pools.events)
    pools.ready.add("prefill-1")
    pools.start_pending()  # a tie (one short each): prefill first
    assert cluster.started == ["prefill-1", "prefill-2"]
    pools.start_pending()  # prefill-2 still starting: no room
    assert cluster.started == ["prefill-1", "prefill-2"]
    pools.ready.add("prefill-2")
    pools.start_pending()
    pools.start_pending()
    assert cluster.started == ["prefill-1", "prefill-2", "decode-1"]


async def test_a_scale_down_takes_pending_workers_first(tmp_path: Path) -> None:
    pools, cluster = _pools(tmp_path, cap=1)
    await pools.scale("prefill", 3)  # prefill-1 starting, one pending
    await pools.scale("prefill", 2)  # the pending one goes; nothing started is stopped
    assert [p.name for p in cluster.procs if p.role == "prefill"] == ["prefill-0", "prefill-1"]
    assert pools.status()[0].current == 2
    pools.ready.add("prefill-1")
    pools.start_pending()
    assert cluster.started == ["prefill-1"]
    await pools.scale("prefill", 1)  # then the newest started one
    assert [p.name for p in cluster.procs if p.role == "prefill"] == ["prefill-0"]
    assert pools.status()[0].current == 1


async def test_no_cap_starts_every_ordered_worker(tmp_path: Path) -> None:
    pools, cluster = _pools(tmp_path, cap=0)
    await pools.scale("prefill", 3)
    await pools.scale("decode", 3)
    assert cluster.started == ["prefill-1", "prefill-2", "decode-1", "decode-2"]


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_the_health_poll_starts_a_pending_worker_once_one_is_ready(
    tmp_path: Path,
) -> None:
    app = web.Application()
    app.router.add_get("/{name}/health", _ok)  # every worker answers: each is ready at once
    runner, url = await start_site(app)
    cluster = _Cluster(tmp_path, url)
    pools = LocalPools(cluster, max_starting=1)  # type: ignore[arg-type]
    pools.ready |= {"prefill-0", "decode-0"}  # up starts autoscaling once they are healthy
    await pools.scale("decode", 3)
    assert cluster.started == ["decode-1"]
    stop = asyncio.Event()
    poll = asyncio.create_task(pools.poll_health(stop, interval_s=0.05))
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(cluster.started) == 2 and "decode-2" in pools.ready:
                break
    finally:
        stop.set()
        await poll
        await runner.cleanup()
    assert cluster.started == ["decode-1", "decode-2"]
    assert {"decode-0", "decode-1", "decode-2"} <= pools.ready


async def test_a_worker_that_was_ready_and_fails_does_not_hold_the_cap(tmp_path: Path) -> None:
    """A hung worker (ready once since its spawn, now failing /health) is not starting:
    with a cap of 1 it would otherwise block every scale-up while it hangs."""
    sick: set[str] = set()

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503 if request.match_info["name"] in sick else 200)

    app = web.Application()
    app.router.add_get("/{name}/health", health)
    runner, url = await start_site(app)
    cluster = _Cluster(tmp_path, url)
    for i, proc in enumerate(cluster.procs):
        proc.spawned_at = 100.0 + i  # spawned, as LocalCluster stamps them
    pools = LocalPools(cluster, max_starting=1)  # type: ignore[arg-type]
    stop = asyncio.Event()
    poll = asyncio.create_task(pools.poll_health(stop, interval_s=0.05))
    try:
        for _ in range(100):  # both ready once (timed from their spawn)
            await asyncio.sleep(0.05)
            if {"prefill-0", "decode-0"} <= pools.ready:
                break
        sick.add("decode-0")
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "decode-0" not in pools.ready:
                break
        assert pools.starting() == 0
        await pools.scale("decode", 2)
        assert cluster.started == ["decode-1"]  # a broken count held it pending
    finally:
        stop.set()
        await poll
        await runner.cleanup()


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return p.parse_args(list(argv))


def test_the_default_cap_follows_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, cap in ((2, 1), (4, 1), (8, 2), (16, 4)):
        monkeypatch.setattr("os.sched_getaffinity", lambda _pid, n=cores: set(range(n)))
        assert max_starting(_args("--autoscale")) == cap
    assert max_starting(_args("--autoscale", "--max-starting", "0")) == 0
    assert max_starting(_args("--autoscale", "--max-starting", "3")) == 3


@pytest.mark.parametrize("argv", [("--autoscale", "--max-starting", "-1"), ("--max-starting", "2")])
def test_a_bad_or_unused_cap_is_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match="--max-starting"):
        up._validate(_args(*argv))
