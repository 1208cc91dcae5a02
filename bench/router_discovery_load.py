"""The router side of bench/operator_load.py: worker discovery by watch vs by polling.

``watchers``: the router's real discovery source (``router/discovery/k8s.py``: one watch
on the EndpointSlices of an LLMService's pool Services). ``pollers``: the design it
replaced, re-created here as the baseline: a pod LIST by label every second. Each router
has its own LLMService's slices and pods, written as the controllers would write them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from pdserve.router.discovery.k8s import KubernetesSource
from pdserve.router.discovery.kube_api import USER_AGENT, ApiAccess

NS = "default"
BASELINE_AGENT = "baseline-router"
POLL_S = 1.0


def _slice(name: str, role: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {
            "name": f"{name}-{role}-x",
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": f"{name}-{role}"},
        },
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
    }


def _pod(name: str, role: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{name}-{role}-x",
            "namespace": NS,
            "labels": {"pdserve.io/service": name, "pdserve.io/role": role},
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


async def write_world(url: str, names: list[str]) -> None:
    async with aiohttp.ClientSession(headers={"User-Agent": "controllers"}) as http:
        for i, name in enumerate(names):
            for j, role in enumerate(("prefill", "decode")):
                ip = f"10.{i // 250}.{i % 250}.{j + 1}"
                for path, body in (
                    ("/apis/discovery.k8s.io/v1", _slice(name, role, ip)),
                    ("/api/v1", _pod(name, role, ip)),
                ):
                    plural = "endpointslices" if body["kind"] == "EndpointSlice" else "pods"
                    async with http.post(f"{url}{path}/namespaces/{NS}/{plural}", json=body) as r:
                        assert r.status in (200, 201), await r.text()


async def _poll(http: aiohttp.ClientSession, url: str, name: str) -> None:
    params = {"labelSelector": f"pdserve.io/service={name},pdserve.io/role in (prefill,decode)"}
    while True:
        async with http.get(f"{url}/api/v1/namespaces/{NS}/pods", params=params) as r:
            await r.read()
        await asyncio.sleep(POLL_S)


@contextlib.asynccontextmanager
async def routers(url: str, watched: list[str], polled: list[str]) -> AsyncIterator[int]:
    """Run the routers' discovery; yields once every watcher has its first LIST. Yields the
    number of endpoints the watchers see (a check that they really discovered workers)."""
    sources = [KubernetesSource(n, NS, access=lambda: ApiAccess(url)) for n in watched]
    async with aiohttp.ClientSession(headers={"User-Agent": BASELINE_AGENT}) as http:
        tasks = [asyncio.create_task(_poll(http, url, n)) for n in polled]
        try:
            seen = [len(await s.list()) for s in sources]
            yield sum(seen)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in sources:
                await s.close()


def requests_of(server: Any, agent: str) -> int:
    """Requests sent by ``agent``, open watch streams not counted (they cost no requests)."""
    return sum(c for (a, _m, watch), c in server.by_agent.items() if a == agent and not watch)


WATCH_AGENT = USER_AGENT
