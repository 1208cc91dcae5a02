"""Item 7 of issue 42: the router's EndpointSlice discovery (router/discovery/k8s.py) reads
the slices the real endpointslice controller writes, under the router's own ServiceAccount
(the Role the operator renders for it). Workers appear as their pods become Ready and go
away when a pod is deleted."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

from pdserve.router.discovery.k8s import KubernetesSource
from pdserve.router.discovery.kube_api import ApiAccess
from pdserve.testing.k8s_real.cluster import OperatorProcess, RealCluster

NS = "llm-b"


async def eventually(check: Any, timeout: float, what: str) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = await check()
        if got:
            return got
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.2)


def pod_urls(c: RealCluster, role: str) -> dict[str, str]:
    pods = c.items(
        f"/api/v1/namespaces/{NS}/pods", f"pdserve.io/service=disc,pdserve.io/role={role}"
    )
    return {
        p["metadata"]["name"]: f"http://{p['status']['podIP']}:8080"
        for p in pods
        if p.get("status", {}).get("podIP") and not p["metadata"].get("deletionTimestamp")
    }


async def test_router_discovery_follows_real_endpointslices(
    chart: RealCluster, operator: OperatorProcess
) -> None:
    c = chart
    c.kubelet.hold.add(NS)  # pods get bound and IPs but stay not Ready until released
    c.kubectl(
        "apply",
        "-f",
        "-",
        stdin=json.dumps(
            {
                "apiVersion": "pdserve.io/v1alpha1",
                "kind": "LLMService",
                "metadata": {"name": "disc", "namespace": NS},
                "spec": {
                    "model": {"source": {"pvc": {"claimName": "models", "path": "m"}}},
                    "prefill": {"replicas": 1},
                    "decode": {"replicas": 2},
                },
            }
        ),
    )
    sas = c.wait(
        lambda: c.items(f"/api/v1/namespaces/{NS}/serviceaccounts", "pdserve.io/service=disc"),
        30,
        what="the router's ServiceAccount",
    )
    token = c.token(sas[0]["metadata"]["name"], NS)
    ctx = ssl.create_default_context(cafile=str(c.plane.ca))
    src = KubernetesSource(
        "disc", NS, port=8080, access=lambda: ApiAccess(c.plane.url, token=token, ssl_context=ctx)
    )
    try:
        c.wait(lambda: len(pod_urls(c, "decode")) == 2, 60, what="two decode pods with IPs")
        assert await src.list() == []  # slices exist, their endpoints are not ready
        c.kubelet.release(NS)

        async def all_workers() -> bool:
            want = {("prefill", u) for u in pod_urls(c, "prefill").values()}
            want |= {("decode", u) for u in pod_urls(c, "decode").values()}
            return len(want) == 3 and {(e.role, e.url) for e in await src.list()} == want

        await eventually(all_workers, 30, "every Ready worker discovered")
        gone_name, gone_url = sorted(pod_urls(c, "decode").items())[0]
        c.kubectl("delete", "pod", gone_name, "-n", NS, "--wait=false")

        async def replaced() -> bool:
            urls = {e.url for e in await src.list() if e.role == "decode"}
            return gone_url not in urls and len(urls) == 2

        await eventually(replaced, 30, "the deleted pod gone, its replacement discovered")
    finally:
        await src.close()
