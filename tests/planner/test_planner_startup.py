"""The planner's start-up horizon is measured (planner/startup.py, local/autoscale.py).

Issue 14 point 1 credits starting pods with their *expected* ready time; on this
machine a worker took 36-92 s to become ready while ``--worker-startup`` said 8 s,
so the planner ordered workers for backlogs its ready worker drained first. Here:
the estimate's rule, that the horizon decides whether a backlog needs a new pod,
that the local loop plans with what its pools measured, and that the pools time a
worker from spawn to its first ``/health`` 200 (a real loopback HTTP server stands
in for the worker: starting a real one takes most of a minute here).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from planner_helpers import config, settled, snap
from test_planner_local import fake_autoscaler

from pdserve.local.autoscale import LocalPools
from pdserve.local.processes import Proc
from pdserve.planner.capacity import ProfileError, load_profile, save_profile
from pdserve.planner.plan import plan
from pdserve.planner.presets import CPU_TINY, H100_LLAMA3_8B
from pdserve.planner.startup import StartupEstimate
from tests.aio_site import start_site

pytestmark = pytest.mark.unit


def test_prior_until_measured_then_a_running_mean_per_pool() -> None:
    est = StartupEstimate(8.0, keep=3)
    assert est.estimate("prefill") == est.planner_startup_s() == 8.0
    est.observe("prefill", 40.0)
    assert est.estimate("prefill") == 40.0 and est.estimate("decode") == 8.0
    assert est.planner_startup_s() == 40.0  # the slower pool's
    for s in (60.0, 50.0, 70.0):  # only the last 3 count
        est.observe("prefill", s)
    assert est.estimate("prefill") == pytest.approx(60.0)
    assert est.observed("prefill") == 3 and "decode 8.0s (0 measured)" in est.describe()
    with pytest.raises(ValueError):
        StartupEstimate(-1.0)


def test_a_worker_stopped_unready_raises_the_estimate_never_lowers_it() -> None:
    est = StartupEstimate(8.0)
    est.observe("decode", 30.0)
    est.stopped_unready("decode", 12.0)  # says only "more than 12 s": no news
    assert est.estimate("decode") == 30.0
    est.stopped_unready("decode", 45.0)  # it was still loading at 45 s
    assert est.estimate("decode") == 45.0
    est.observe("decode", 50.0)  # a finished start-up replaces the bound
    assert est.estimate("decode") == pytest.approx(40.0)


def _backlog(depth: float):  # one ready prefill replica, demand well under its capacity
    return snap(
        prefill=(1, 1, 0),
        decode=(2, 2, 0),
        rps=5,
        prompt=2000,
        output=100,
        decode_running=200,
        prefill_queue_depth=depth,
    )


def test_the_horizon_decides_whether_a_backlog_needs_a_new_pod() -> None:
    # 400k queued prompt tokens on one replica of ~19k tokens/s that sees 10k/s: it drains
    # in ~45 s. A pod ready in 8 s is worth ordering; one ready in 60 s would come too late
    fast, _ = plan(_backlog(200), settled(1, 2), config(startup_s=8.0))
    slow, _ = plan(_backlog(200), settled(1, 2), config(startup_s=60.0))
    assert fast.prefill.desired == 2 and "forecast queued in 8s" in fast.prefill.reason
    assert slow.prefill.desired == 1 and slow.details["prefill_queue_at_ready"] == 0
    assert slow.details["startup_s"] == 60.0
    # a backlog that outlasts even a slow start-up still gets its pod
    big, _ = plan(_backlog(400), settled(1, 2), config(startup_s=60.0))
    assert big.prefill.desired == 2 and big.details["prefill_queue_at_ready"] > 0


async def test_the_local_loop_plans_with_the_measured_startup() -> None:
    est = StartupEstimate(8.0)
    auto, router, _, clock = fake_autoscaler("--worker-startup", "8")
    auto._startup_s = est.planner_startup_s  # what LocalAutoscaling wires in
    await auto.step()
    clock.t = 10.0
    router.serve_interval(20, ttft=0.2, tpot=0.05, prompt=100, output=20)
    first = await auto.step()
    assert first is not None and first.details["startup_s"] == 8.0  # the prior
    est.observe("decode", 47.5)
    clock.t = 20.0
    router.serve_interval(20, ttft=0.2, tpot=0.05, prompt=100, output=20)
    second = await auto.step()
    assert second is not None and second.details["startup_s"] == 47.5
    assert auto.config.startup_s == 8.0  # the configured prior is kept as given


class _FakeCluster:
    """Only what LocalPools uses: the worker list and remove_worker (no processes)."""

    def __init__(self, procs: list[Proc]) -> None:
        self.procs = procs

    def remove_worker(self, proc: Proc, *_: object) -> bool:
        self.procs.remove(proc)
        return True


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_pools_time_each_worker_from_spawn_to_health(tmp_path: Path) -> None:
    app = web.Application()
    app.router.add_get("/health", _ok)
    runner, url = await start_site(app)
    ready = Proc("prefill-0", "prefill", url, [], tmp_path / "p0.log")
    loading = Proc("decode-1", "decode", "http://127.0.0.1:9", [], tmp_path / "d1.log")
    ready.spawned_at = time.monotonic() - 30.0
    loading.spawned_at = time.monotonic() - 55.0
    pools = LocalPools(_FakeCluster([ready, loading]), startup=StartupEstimate(8.0))  # type: ignore[arg-type]
    stop = asyncio.Event()
    poll = asyncio.create_task(pools.poll_health(stop, interval_s=0.05))
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if "prefill-0" in pools.ready:
                break
        await asyncio.sleep(0.2)  # more polls: a worker is timed once per spawn
    finally:
        stop.set()
        await poll
        await runner.cleanup()
    assert pools.startup.observed("prefill") == 1
    assert 30.0 <= pools.startup.estimate("prefill") < 40.0
    assert any(e.startswith("prefill-0 ready after 3") for e in pools.events)
    await pools.scale("decode", 0)  # stopped while still loading at 55 s
    assert pools.startup.estimate("decode") >= 55.0
    assert pools.startup.planner_startup_s() >= 55.0


def test_a_profile_carries_its_startup_and_where_it_comes_from(tmp_path: Path) -> None:
    """The simulated cluster's pod start-up comes from the profile, with its source."""
    from pdserve.planner.sim.scenarios import setup

    assert H100_LLAMA3_8B.startup_s == 40.0
    assert H100_LLAMA3_8B.startup_source.startswith("assumed:")
    assert setup("h100-llama3-8b", 1.15).cost.startup_s == 40.0
    measured = replace(CPU_TINY, startup_s=33.5, startup_source="measured: a test")
    path = tmp_path / "p.json"
    save_profile(measured, path)
    assert load_profile(path) == measured  # round trip
    assert setup(str(path), 1.0).cost.startup_s == 33.5
    save_profile(CPU_TINY, path)  # none given: the simulator's stated default
    assert load_profile(path).startup_s is None and setup(str(path), 1.0).cost.startup_s == 10.0
    body = json.loads(path.read_text())
    for bad in (-1.0, "40", True):
        path.write_text(json.dumps({**body, "startup_s": bad}))
        with pytest.raises(ProfileError, match="startup_s"):
            load_profile(path)


@pytest.mark.timeout(180)
def test_pdserve_profile_measures_the_startup(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    grid = ["--prompt-lengths", "32,64,128", "--batches", "1,2", "--contexts", "32,64"]
    engine = ["--model", str(tiny_model_dir), "--device", "cpu", "--enforce-eager"]
    cmd = [sys.executable, "-m", "pdserve", "profile", *engine, *grid, "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=170)
    prof = load_profile(out)
    assert prof.startup_s is not None and 0 < prof.startup_s < 170
    assert prof.startup_source.startswith("measured: pdserve profile on ")
    assert "process start to engine ready" in prof.startup_source


def _pod(uid: str, created: str, ready_at: str | None, restarts: int = 0) -> dict:
    conditions = [{"type": "Ready", "status": "True", "lastTransitionTime": ready_at}]
    return {
        "metadata": {"uid": uid, "creationTimestamp": created},
        "status": {
            "conditions": conditions if ready_at else [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"restartCount": restarts}],
        },
    }


def test_the_operator_times_pods_from_creation_to_ready() -> None:
    """operator/autoscale_inputs.pod_startups and the autoscaler memo that learns from it
    (the pods a pool listing returns; plain dicts as the API server sends them)."""
    from pdserve.operator.autoscale_inputs import pod_startups
    from pdserve.operator.autoscaler import AutoscalerMemo

    pods = [
        _pod("a", "2026-12-01T04:00:00Z", "2026-12-01T04:00:41Z"),
        _pod("b", "2026-12-01T04:00:00Z", "2026-12-01T04:05:00Z", restarts=1),  # a restart
        _pod("c", "2026-12-01T04:00:10Z", None),  # still starting
        _pod("d", "not a time", "2026-12-01T04:00:41Z"),
    ]
    assert pod_startups(pods) == [("a", 41.0)]
    am = AutoscalerMemo(startup=StartupEstimate(30.0))
    am.learn("decode")(pods)
    am.learn("decode")(pods)  # listed again next interval: counted once
    assert am.startup is not None and am.startup.observed("decode") == 1
    assert am.startup.planner_startup_s() == 41.0
