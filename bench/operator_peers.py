"""The operator as the chart ships it, for bench/operator_load.py: two replicas with kopf
peering, and every request they send counted at the emulator.

The chart (charts/pdserve) runs ``operator.replicas: 2`` with ``--peering``: one replica
is active, the other stands by, and both PATCH their keep-alive into the KopfPeering
object every 5-10 s (kopf: ``lifetime - randint(5, 10)``, lifetime 15 s here), which
each replica's peering watch then reads. Each replica runs in its own thread and event
loop, as in its own pod (kopf reaps every kopf task of its loop at exit).

``CountingServer`` counts each request by (User-Agent product, method, watch?, resource
plural): a watch is one request when it opens (its stream then costs nothing), and a
request is the operator's unless one of the bench's own agents sent it, so nothing the
operator sends under an unexpected agent goes uncounted.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import aiohttp
import attrs

from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.kube import KubeClient
from pdserve.testing.k8s_emulator import ApiServer
from pdserve.testing.operator_replica import OperatorReplica

NS = "default"
PEERING = "pdserve-operator"  # the chart's --peering name (pdserve.operatorName)
REPLICAS = 2  # the chart's operator.replicas

Key = tuple[str, str, bool, str]  # (agent, method, watch?, resource plural)


@attrs.define(kw_only=True)
class CountingServer(ApiServer):
    by_resource: collections.Counter[Key] = attrs.field(factory=collections.Counter, init=False)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        agent = raw_request.headers.get("User-Agent", "").split("/")[0]
        watch = raw_request.query.get("watch") == "true"
        key = (agent, raw_request.method, watch, _plural(raw_request.path))
        self.by_resource[key] += 1
        return await super().__call__(raw_request)


def _plural(path: str) -> str:
    """The resource of an API path: /apis/G/V/namespaces/NS/PLURAL[/NAME[/status]]."""
    parts = [p for p in path.split("/") if p]
    if "namespaces" in parts:
        i = parts.index("namespaces")
        return parts[i + 2] if len(parts) > i + 2 else "namespaces"
    return parts[-1] if parts else ""


def window(
    before: collections.Counter[Key], after: collections.Counter[Key], ours: set[str]
) -> dict[str, Any]:
    """The operator's requests between two counts: every agent but the bench's own."""
    diff = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
    theirs = {k: v for k, v in diff.items() if k[0] not in ours}
    by: dict[str, int] = collections.Counter()
    for (agent, method, watch, plural), v in theirs.items():
        by[f"{agent} {'WATCH' if watch else method} {plural}"] += v
    return {
        "requests": sum(theirs.values()),
        "watch_requests": sum(v for k, v in theirs.items() if k[2]),
        "peering_requests": sum(v for k, v in theirs.items() if k[3] == "kopfpeerings"),
        "by_request": dict(sorted(by.items())),
    }


async def start_replicas(client: KubeClient, config: OperatorConfig) -> list[OperatorReplica]:
    """The chart's KopfPeering, then its replicas (the first one active: the higher
    priority, registered first so the standby's first look sees it)."""
    await client.create(
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": PEERING, "namespace": NS},
        }
    )
    replicas = []
    for i in range(REPLICAS):
        replicas.append(OperatorReplica(config, 100 - i, PEERING, NS))
        replicas[-1].start()
        await _peers_at_least(client, i + 1, 60.0)
    return replicas


async def _peers_at_least(client: KubeClient, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obj = await client.get("kopf.dev/v1", "KopfPeering", NS, PEERING)
        if len((obj or {}).get("status") or {}) >= n:
            return
        await asyncio.sleep(0.2)
    raise SystemExit(f"{n} operator replicas did not register in the peering in {timeout}s")
