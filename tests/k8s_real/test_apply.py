"""Item 3 of issue 42: ``kubectl apply -f examples/*.yaml`` on the real control plane, the
operator running under the chart's ServiceAccount token: children with owner references,
ReplicaSets and Pods made by the controller-manager and admitted by PodSecurity, status
conditions driven by Ready pods, printer columns."""

from __future__ import annotations

import base64
import json
from typing import Any

from pdserve.testing.k8s_real.cluster import (
    ROOT,
    OperatorProcess,
    RealCluster,
    conditions,
    is_ready,
    read_only_pvc,
)

CHILD_KINDS = {
    "deployments": "/apis/apps/v1/namespaces/{ns}/deployments",
    "services": "/api/v1/namespaces/{ns}/services",
    "configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "networkpolicies": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "poddisruptionbudgets": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "ingresses": "/apis/networking.k8s.io/v1/namespaces/{ns}/ingresses",
}


def children(c: RealCluster, ns: str, name: str) -> dict[str, list[dict[str, Any]]]:
    sel = f"pdserve.io/service={name}"
    return {kind: c.items(path.format(ns=ns), sel) for kind, path in CHILD_KINDS.items()}


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    refs = obj["metadata"].get("ownerReferences", [])
    return any(r["uid"] == owner["metadata"]["uid"] and r.get("controller") for r in refs)


def wait_ready(c: RealCluster, ns: str, name: str, timeout: float = 90) -> dict[str, Any]:
    path = f"/apis/pdserve.io/v1alpha1/namespaces/{ns}/llmservices/{name}"

    def ready() -> dict[str, Any] | None:
        obj = c.get(path)
        return obj if is_ready(obj) else None

    return c.wait(ready, timeout, what=f"{ns}/{name} Ready: {json.dumps(c.get(path))[-1500:]}")  # type: ignore[no-any-return]


def _gpu_prerequisites(c: RealCluster) -> None:
    """What the GPU example references: its API key Secret, TLS Secret and model PVC."""
    key = base64.b64encode(b"sk-test").decode()
    c.kubectl(
        "create",
        "secret",
        "generic",
        "llama-api-key",
        "-n",
        "llm",
        "--from-literal=api-key=sk-test",
    )
    tls = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": "llama-tls"},
        "data": {"tls.crt": key, "tls.key": key},
    }
    c.apply_object("llm", tls)
    c.apply_object("llm", read_only_pvc("model-weights", "20Gi"))


def test_examples_apply_reconcile_and_become_ready(
    chart: RealCluster, operator: OperatorProcess
) -> None:
    c = chart
    _gpu_prerequisites(c)
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        c.kubectl("apply", "-f", str(example))
    for ns, name, pools in (("default", "tiny", 1), ("llm", "llama3-8b", 2)):
        obj = wait_ready(c, ns, name)
        assert conditions(obj)["Ready"].get("observedGeneration") == obj["metadata"]["generation"]
        kids = children(c, ns, name)
        assert len(kids["deployments"]) == 3, kids["deployments"]
        assert kids["services"] and kids["configmaps"] and kids["networkpolicies"]
        multi = [d for d in kids["deployments"] if d["spec"]["replicas"] > 1]  # a PDB each
        assert len(kids["poddisruptionbudgets"]) == len(multi) >= (2 if pools > 1 else 0)
        assert all(owned_by(o, obj) for objs in kids.values() for o in objs)
        # the controller-manager's ReplicaSets and Pods, admitted by PodSecurity
        for dep in kids["deployments"]:
            rs = [
                r for r in c.items(f"/apis/apps/v1/namespaces/{ns}/replicasets") if owned_by(r, dep)
            ]
            assert len(rs) == 1, f"{dep['metadata']['name']}: {len(rs)} ReplicaSets"
            assert rs[0]["status"].get("readyReplicas") == dep["spec"]["replicas"], rs[0]["status"]
    assert len(children(c, "llm", "llama3-8b")["ingresses"]) == 1
    out = c.kubectl("get", "llmservices", "-n", "default").stdout
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "PREFILL", "DECODE", "READY", "ENDPOINT", "AGE"], out
    assert row.split()[:4] == ["tiny", "1/1", "1/1", "True"], out
