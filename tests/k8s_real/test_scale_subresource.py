"""Item 5 of issue 42: the autoscaler scales a pool through the Deployment's ``/scale``
subresource on a real API server, under the chart's ServiceAccount (RBAC grants
``deployments/scale`` get and patch), and the operator keeps the count it set."""

from __future__ import annotations

import asyncio
import json

import kopf

from pdserve.operator.kube import USER_AGENT, KubeClient
from pdserve.operator.scaling import ScaleResult, scale_pools
from pdserve.testing.k8s_real.cluster import (
    OPERATOR_SA,
    SYSTEM_NS,
    OperatorProcess,
    RealCluster,
    llmservice,
    settle,
)
from tests.k8s_real.test_apply import wait_ready

NS = "llm-a"
DEP = f"/apis/apps/v1/namespaces/{NS}/deployments"
AS_OPERATOR = f"--as=system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}"


def _autoscaled(name: str) -> str:
    decode = {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}
    return json.dumps(llmservice(name, NS, decode=decode, autoscaling={"enabled": True}))


def _scale_as_operator(c: RealCluster, name: str, decode: int) -> ScaleResult:
    """The autoscaler's write path, logged in with the chart's ServiceAccount token."""
    info = kopf.ConnectionInfo(
        server=c.plane.url,
        ca_path=str(c.plane.ca),
        scheme="Bearer",
        token=c.token(OPERATOR_SA, SYSTEM_NS),
    )

    async def scale() -> ScaleResult:
        client = KubeClient(info)
        try:
            return await scale_pools(client, NS, name, 1, decode, "test: a load step")
        finally:
            await client.close()

    return asyncio.run(scale())


def test_the_autoscaler_scales_through_the_scale_subresource(
    chart: RealCluster, operator: OperatorProcess
) -> None:
    c = chart
    for verb, want in (("patch", "yes"), ("get", "yes"), ("update", "no")):
        can = c.kubectl(
            "auth", "can-i", verb, "deployments/scale", "-n", NS, AS_OPERATOR, check=False
        )
        assert can.stdout.strip() == want, (verb, can.stdout, can.stderr)
    c.kubectl("apply", "-f", "-", stdin=_autoscaled("scaled-up"))
    wait_ready(c, NS, "scaled-up")
    result = _scale_as_operator(c, "scaled-up", 3)
    assert result.changed == ("Deployment/scaled-up-decode",), result
    dep = c.get(f"{DEP}/scaled-up-decode")
    assert dep is not None and dep["spec"]["replicas"] == 3
    # the API server records who set what through which subresource
    scale_writes = [f for f in dep["metadata"]["managedFields"] if f.get("subresource") == "scale"]
    assert [f["manager"] for f in scale_writes] == [USER_AGENT], dep["metadata"]["managedFields"]
    assert "f:replicas" in json.dumps(scale_writes[0]["fieldsV1"])
    pods = f"/api/v1/namespaces/{NS}/pods"
    sel = "pdserve.io/service=scaled-up,pdserve.io/role=decode"
    c.wait(lambda: len(c.items(pods, sel)) == 3, 30, what="three decode pods")
    settle(3)  # the operator's reconcile (at the Deployment's events) keeps the autoscaled count
    dep = c.get(f"{DEP}/scaled-up-decode")
    assert dep is not None and dep["spec"]["replicas"] == 3
    # clamped to maxReplicas by the same path
    assert _scale_as_operator(c, "scaled-up", 9).decode == 4
    c.wait(lambda: (c.get(f"{DEP}/scaled-up-decode") or {})["spec"]["replicas"] == 4, 10)
