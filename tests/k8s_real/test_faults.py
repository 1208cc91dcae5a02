"""Item 6 of issue 42 on the real control plane: garbage collection of every child, an API
server restart mid-reconcile, the operator killed half-way through creating, two replicas
with the shipped peering. Each ends with no duplicate object and nothing left behind."""

from __future__ import annotations

import json
from typing import Any

from pdserve.testing.k8s_real import cluster
from pdserve.testing.k8s_real.cluster import OperatorProcess, RealCluster
from tests.k8s_real.test_apply import owned_by, wait_ready

NS = "llm-a"
API = f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices"
# Everything the operator or the controllers make for one LLMService in llm-a.
KINDS = {
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "ReplicaSet": "/apis/apps/v1/namespaces/{ns}/replicasets",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Service": "/api/v1/namespaces/{ns}/services",
    "ConfigMap": "/api/v1/namespaces/{ns}/configmaps",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "EndpointSlice": "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
}


def llmservice(name: str, replicas: int = 1) -> str:
    pools = {"prefill": {"replicas": replicas}, "decode": {"replicas": replicas}}
    return json.dumps(cluster.llmservice(name, NS, **pools))


def objects(c: RealCluster, name: str) -> list[dict[str, Any]]:
    """Every object in NS that belongs to ``name`` (by label, or through its owner chain)."""
    found = []
    for path in KINDS.values():
        for obj in c.items(path.format(ns=NS)):
            meta = obj["metadata"]
            labels = meta.get("labels", {})
            if labels.get("pdserve.io/service") == name or meta["name"].startswith(f"{name}-"):
                found.append(obj)
    return found


def no_duplicates(c: RealCluster, name: str, replicas: int = 1) -> None:
    deps = c.items(KINDS["Deployment"].format(ns=NS), f"pdserve.io/service={name}")
    assert sorted(d["metadata"]["name"] for d in deps) == [
        f"{name}-decode",
        f"{name}-prefill",
        f"{name}-router",
    ]
    for dep in deps:
        rs = [r for r in c.items(KINDS["ReplicaSet"].format(ns=NS)) if owned_by(r, dep)]
        assert len(rs) == 1, f"{dep['metadata']['name']}: {len(rs)} ReplicaSets"
    pods = c.items(KINDS["Pod"].format(ns=NS), f"pdserve.io/service={name}")
    assert len(pods) == 1 + 2 * replicas, [p["metadata"]["name"] for p in pods]


def test_delete_garbage_collects_every_child(chart: RealCluster, operator: OperatorProcess) -> None:
    c = chart
    c.kubectl("apply", "-f", "-", stdin=llmservice("gc"))
    wait_ready(c, NS, "gc")
    before = objects(c, "gc")
    assert {o["metadata"]["name"] for o in before} >= {"gc", "gc-router", "gc-prefill", "gc-decode"}
    c.kubectl("delete", "llmservice", "gc", "-n", NS, "--wait=true")
    c.wait(
        lambda: not objects(c, "gc"),
        60,
        what=f"children of gc collected; left: {[o['metadata']['name'] for o in objects(c, 'gc')]}",
    )


def test_apiserver_restart_mid_reconcile(chart: RealCluster, operator: OperatorProcess) -> None:
    c = chart
    c.kubectl("apply", "-f", "-", stdin=llmservice("restart"))
    c.wait(
        lambda: c.items(KINDS["Deployment"].format(ns=NS), "pdserve.io/service=restart"),
        30,
        what="the first child of restart",
    )
    c.plane.restart("kube-apiserver")
    wait_ready(c, NS, "restart", timeout=120)
    no_duplicates(c, "restart")
    # the operator's watches resumed: a new object after the restart is reconciled too
    c.kubectl("apply", "-f", "-", stdin=llmservice("after-restart"))
    wait_ready(c, NS, "after-restart")
    no_duplicates(c, "after-restart")
    assert operator.proc.poll() is None, operator.log()


def test_etcd_restart(chart: RealCluster, operator: OperatorProcess) -> None:
    """etcd stops and comes back (same data dir): the API server reconnects, the operator's
    watches resume, and what was there is still there, once."""
    c = chart
    c.kubectl("apply", "-f", "-", stdin=llmservice("etcd-before"))
    wait_ready(c, NS, "etcd-before")
    c.plane.restart("etcd")
    c.wait(lambda: c.plane.ok(c.plane.url + "/readyz", admin=True), 60, what="readyz after etcd")
    c.kubectl("apply", "-f", "-", stdin=llmservice("etcd-after"))
    wait_ready(c, NS, "etcd-after", timeout=120)
    no_duplicates(c, "etcd-before")
    no_duplicates(c, "etcd-after")


def test_operator_killed_mid_create(chart: RealCluster, operator: OperatorProcess) -> None:
    c = chart
    c.kubectl("apply", "-f", "-", stdin=llmservice("killed", replicas=2))
    c.wait(
        lambda: c.items(KINDS["ConfigMap"].format(ns=NS), "pdserve.io/service=killed"),
        30,
        what="the first child of killed",
    )
    operator.restart()  # SIGKILL half-way, then a new replica
    wait_ready(c, NS, "killed", timeout=120)
    no_duplicates(c, "killed", replicas=2)
    c.kubectl("delete", "llmservice", "killed", "-n", NS, "--wait=true")
    c.wait(lambda: not objects(c, "killed"), 60, what="killed's children collected")
