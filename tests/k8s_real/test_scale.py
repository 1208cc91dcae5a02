"""Item 5 of issue 42: a person's ``kubectl scale`` (the Deployment's scale subresource) meets
the operator on a real API server, and a model change rolls out through a new ReplicaSet.

Who wins (docs/kubernetes.md, "Scaling"): without autoscaling the LLMService's spec is the
truth and the operator reverts the drift at the Deployment's watch event; with
``externalScaling`` (an HPA, KEDA, a person) the operator keeps the count it finds, clamped
to the pool's bounds."""

from __future__ import annotations

import json
from typing import Any

from pdserve.testing.k8s_real.cluster import OperatorProcess, RealCluster, conditions, llmservice
from tests.k8s_real.test_apply import owned_by, wait_ready

NS = "llm-a"
DEP = f"/apis/apps/v1/namespaces/{NS}/deployments"


def service(name: str, **decode: Any) -> str:
    return json.dumps(llmservice(name, NS, decode={"replicas": 1, **decode}))


def replicas(c: RealCluster, name: str) -> int:
    dep = c.get(f"{DEP}/{name}-decode")
    assert dep is not None
    return int(dep["spec"]["replicas"])


def test_kubectl_scale_meets_the_operator(chart: RealCluster, operator: OperatorProcess) -> None:
    c = chart
    c.kubectl("apply", "-f", "-", stdin=service("scaled"))
    wait_ready(c, NS, "scaled")
    c.kubectl("scale", "deployment/scaled-decode", "-n", NS, "--replicas=3")
    c.wait(lambda: replicas(c, "scaled") == 1, 30, what="the operator reverts a person's scale")
    # an external scaler owns the count: kept within bounds, clamped outside them
    c.kubectl(
        "apply",
        "-f",
        "-",
        stdin=service("scaled", externalScaling=True, minReplicas=1, maxReplicas=4),
    )
    c.kubectl("scale", "deployment/scaled-decode", "-n", NS, "--replicas=3")
    wait_ready(c, NS, "scaled")
    sel = "pdserve.io/service=scaled,pdserve.io/role=decode"
    pods = f"/api/v1/namespaces/{NS}/pods"
    c.wait(lambda: len(c.items(pods, sel)) == 3, 30, what="three decode pods")
    assert replicas(c, "scaled") == 3
    c.kubectl("scale", "deployment/scaled-decode", "-n", NS, "--replicas=9")
    c.wait(lambda: replicas(c, "scaled") == 4, 30, what="clamped to maxReplicas")


def test_model_change_rolls_out(chart: RealCluster, operator: OperatorProcess) -> None:
    c = chart
    c.kubectl("apply", "-f", "-", stdin=service("rolled"))
    first = wait_ready(c, NS, "rolled")
    body = json.loads(service("rolled"))
    body["spec"]["model"]["source"]["pvc"]["path"] = "m2"
    c.kubectl("apply", "-f", "-", stdin=json.dumps(body))
    dep = c.get(f"{DEP}/rolled-decode")
    assert dep is not None

    def rolled() -> bool:
        d = c.get(f"{DEP}/rolled-decode") or {}
        rs = [r for r in c.items(f"/apis/apps/v1/namespaces/{NS}/replicasets") if owned_by(r, d)]
        obj = c.get(f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices/rolled") or {}
        ready = conditions(obj).get("Ready", {})
        return (
            len(rs) == 2
            and d["status"].get("updatedReplicas") == 1
            and d["status"].get("observedGeneration") == d["metadata"]["generation"]
            and ready.get("observedGeneration") == obj["metadata"]["generation"]
            and ready.get("status") == "True"
        )

    c.wait(rolled, 60, what="a new ReplicaSet for the new model, Ready again")
    obj = c.get(f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices/rolled")
    assert obj is not None and obj["metadata"]["generation"] > first["metadata"]["generation"]
