"""API load of the operator: N LLMServices against the Kubernetes API emulator.

The real operator (kopf + pdserve handlers, in this process) reconciles N LLMServices
created at once; a stand-in Deployment controller then marks every pool ready, and the
operator settles. Measured:

- ``apply_to_children_p50_s`` / ``apply_to_children_p99_s``: from an LLMService's
  creation to all of its rendered children existing (objects arrive in waves of 10);
- ``api_requests_per_object_minute``: requests the operator sends (User-Agent ``kopf``
  or ``pdserve-operator``; long-lived watch streams not counted) during a steady-state
  window, per LLMService and minute. Goal: <= 2. The operator is watch-driven: an idle
  fleet should cost (almost) nothing; the polling design it replaced sent ~19 GETs per
  object every 10 s (~114 per object-minute, computed: that code is gone);
- ``router_requests_per_replica_minute`` vs ``baseline_router_requests_per_replica_minute``:
  side by side in the same window, ``--routers`` router discovery sources (the router's
  real EndpointSlice watch, ``router/discovery_k8s.py``) and as many of the design it
  replaced (a pod LIST by label every second), each on its own LLMService's pools.

The emulator is tests/k8s/k8s_emulator.py (PyPI ``kmock``); a plot goes to bench/out/.

    python bench/operator_load.py            # 100 LLMServices, 10 + 10 routers, 60 s window
    python bench/operator_load.py --quick    # 5 LLMServices, 2 + 2 routers, 5 s window
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

import aiohttp  # noqa: E402
import kmock  # noqa: E402
import kopf  # noqa: E402
import yaml  # noqa: E402
from k8s_emulator import ApiServer  # noqa: E402
from router_discovery_load import (  # noqa: E402
    BASELINE_AGENT,
    WATCH_AGENT,
    requests_of,
    routers,
    write_world,
)

from pdserve.operator.cache import WATCHED  # noqa: E402
from pdserve.operator.handlers import OperatorConfig  # noqa: E402
from pdserve.operator.kube import KubeClient  # noqa: E402
from pdserve.operator.main import build_registry  # noqa: E402
from pdserve.operator.render import render  # noqa: E402

NS = "default"
OPERATOR_AGENTS = ("kopf", "pdserve-operator")
BATCH = 10
ALL_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def declare(server: ApiServer) -> None:
    server.resources["pdserve.io/v1alpha1/llmservices"] = kmock.ResourceInfo(
        kind="LLMService", namespaced=True, verbs=ALL_VERBS, subresources={"status"}
    )
    for w in WATCHED:
        server.resources[f"{w.api_version}/{w.plural}"] = kmock.ResourceInfo(
            kind=w.kind, namespaced=True, verbs=ALL_VERBS
        )
    server.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
        kind="EndpointSlice", namespaced=True, verbs=ALL_VERBS
    )
    server.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", namespaced=True, verbs=ALL_VERBS)
    read = {"get", "list", "watch"}
    server.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs=read
    )
    server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=read
    )


def llmservice(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": f"svc{i:03d}", "namespace": NS},
        "spec": {"model": {"source": {"hostPath": {"path": "/models/tiny"}}}},
    }


def children_done(server: ApiServer, expected: dict[str, set[tuple[str, str]]]) -> set[str]:
    live = {(o["kind"], o["metadata"]["name"]) for (_r, _ns, _n), o in server.objects.items()
            if not o.deleted}  # fmt: skip
    return {name for name, kids in expected.items() if kids <= live}


async def wait_applied(
    server: ApiServer, objs: list[dict[str, Any]], created: dict[str, float], timeout: float
) -> dict[str, float]:
    """Seconds from each object's creation to all its children existing (read in-process)."""
    expected = {o["metadata"]["name"]: {(m["kind"], m["metadata"]["name"]) for m in render(o)}
                for o in objs}  # fmt: skip
    latency: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(latency) < len(objs) and time.monotonic() < deadline:
        now = time.monotonic()
        for name in children_done(server, expected) - set(latency):
            latency[name] = now - created[name]
        await asyncio.sleep(0.05)
    if len(latency) < len(objs):
        raise SystemExit(f"only {len(latency)}/{len(objs)} LLMServices applied in {timeout}s")
    return latency


async def mark_ready(client: KubeClient, names: list[str]) -> None:
    """The Deployment controller's part: every replica updated and ready."""
    for name in names:
        for role in ("router", "prefill", "decode"):
            st = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}
            await client.patch("apps/v1", "Deployment", NS, f"{name}-{role}", {"status": st},
                               status=True)  # fmt: skip


def plot(latency: list[float], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4))
    a.hist(latency, bins=30)
    a.set_xlabel("create -> all children exist (s)")
    a.set_ylabel("LLMServices")
    a.set_title(f"{result['llmservices']} LLMServices, waves of {BATCH}")
    b.bar(["watch-driven\n(measured)", "polling, replaced\n(computed: 19 GETs/10 s)"],
          [result["api_requests_per_object_minute"], 114.0])  # fmt: skip
    b.axhline(2.0, color="red", linestyle="--", label="goal <= 2")
    b.set_ylabel("operator API requests per object-minute")
    b.legend()
    c.bar(["EndpointSlice watch", "pod LIST every 1 s"],
          [result["router_requests_per_replica_minute"],
           result["baseline_router_requests_per_replica_minute"]])  # fmt: skip
    c.set_ylabel("router API requests per replica-minute")
    c.set_title(f"{result['routers']} routers each, same window (measured)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


async def run(n: int, window_s: float, n_routers: int, png: Path) -> dict[str, Any]:
    async with ApiServer() as server, kmock.Server(server):
        declare(server)
        url = str(server.url).rstrip("/")
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = Path(tmp) / "kubeconfig"
            kubeconfig.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "emu",
                "clusters": [{"name": "emu", "cluster": {"server": url}}],
                "users": [{"name": "bench", "user": {"token": "t"}}],
                "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "bench"}}],
            }))  # fmt: skip
            os.environ["KUBECONFIG"] = str(kubeconfig)
            os.environ.pop("KUBERNETES_SERVICE_HOST", None)
            return await measure(server, url, n, window_s, n_routers, png)


async def create_fleet(server: ApiServer, client: KubeClient, n: int) -> dict[str, float]:
    """Create ``n`` LLMServices in waves; seconds from each one's creation to its children."""
    objs = [llmservice(i) for i in range(n)]
    created: dict[str, float] = {}
    latency: dict[str, float] = {}
    # Arrivals in waves of BATCH (the emulator is one Python process: 100 objects at
    # once = 1,200 child creates in one burst, which it serves slower than any cluster).
    for start in range(0, n, BATCH):
        wave = objs[start : start + BATCH]
        for obj in wave:
            created[obj["metadata"]["name"]] = time.monotonic()
            await client.create(obj)
        latency |= await wait_applied(server, wave, created, timeout=300)
    await mark_ready(client, list(created))
    return latency


async def steady(
    server: ApiServer, url: str, names: list[str], n_routers: int, window_s: float
) -> dict[str, Any]:
    """Requests during ``window_s`` of an idle fleet: the operator's and the routers'."""
    watched, polled = names[:n_routers], names[n_routers : 2 * n_routers]
    await write_world(url, watched + polled)
    agents = (OPERATOR_AGENTS, (WATCH_AGENT,), (BASELINE_AGENT,))
    async with routers(url, watched, polled) as endpoints:
        assert endpoints == 2 * len(watched), f"watchers found {endpoints} workers"
        before, started = (
            [sum(requests_of(server, a) for a in ag) for ag in agents],
            time.monotonic(),
        )
        await asyncio.sleep(window_s)
        after = [sum(requests_of(server, a) for a in ag) for ag in agents]
    minutes = (time.monotonic() - started) / 60
    operator, watch, poll = (b - a for a, b in zip(before, after, strict=True))
    per_router = max(len(watched), 1) * minutes
    return {
        "steady_window_s": window_s,
        "steady_operator_requests": operator,
        "api_requests_per_object_minute": round(operator / len(names) / minutes, 3),
        "routers": len(watched),
        "router_requests_per_replica_minute": round(watch / per_router, 3),
        "baseline_router_requests_per_replica_minute": round(poll / per_router, 3),
    }


async def measure(
    server: ApiServer, url: str, n: int, window_s: float, n_routers: int, png: Path
) -> dict[str, Any]:
    config = OperatorConfig(status_interval=60.0, retry_delay=5.0)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        registry=build_registry(config), namespaces=[NS], standalone=True,
        stop_flag=stop, ready_flag=ready,
    ))  # fmt: skip
    client = KubeClient(kopf.ConnectionInfo(server=url))
    client.session.headers["User-Agent"] = "bench"
    client.session._timeout = aiohttp.ClientTimeout(total=300)  # the emulator may lag
    try:
        await asyncio.wait_for(ready.wait(), 60)
        latency = await create_fleet(server, client, n)
        await asyncio.sleep(3.0 + n / 20)  # status settles (Ready=True written once per object)
        result = await steady(server, url, sorted(latency), min(n_routers, n // 2), window_s)
    finally:
        await client.close()
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
    lat = sorted(latency.values())
    result = {
        "llmservices": n, **result,
        "apply_to_children_p50_s": round(statistics.median(lat), 3),
        "apply_to_children_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
        "goal_met": result["api_requests_per_object_minute"] <= 2.0,
    }  # fmt: skip
    plot(lat, result, png)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 objects, 2 + 2 routers, 5 s")
    parser.add_argument("--objects", type=int, default=None)
    parser.add_argument("--routers", type=int, default=None,
                        help="routers of each kind (watch / baseline poll)")  # fmt: skip
    parser.add_argument("--window", type=float, default=None, help="steady-state seconds")
    args = parser.parse_args()
    n = args.objects or (5 if args.quick else 100)
    window = args.window or (5.0 if args.quick else 60.0)
    n_routers = args.routers if args.routers is not None else (2 if args.quick else 10)
    # --quick (the test suite) must not overwrite the full run's figure
    png = ROOT / "bench" / "out" / f"operator_load{'-quick' if args.quick else ''}.png"
    result = asyncio.run(run(n, window, n_routers, png))
    print(json.dumps(result))
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
