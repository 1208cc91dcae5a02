"""Item 3 of issue 42: ``kubectl apply -f examples/*.yaml`` on the real control plane, the
operator running under the chart's ServiceAccount token: children with owner references,
ReplicaSets and Pods made by the controller-manager and admitted by PodSecurity, status
conditions driven by Ready pods, printer columns. Beside them, a service with limits and
a shared cache (issue 44): what the API server stored for its per-key budgets across
router replicas (``--budget-peers kubernetes``, ``POD_IP`` from the downward API, the
NetworkPolicy's admin-port rule selecting the service's own router pods) and the
router's read-only mount of the compiled-code folder."""

from __future__ import annotations

import base64
import json
from typing import Any

from pdserve.operator import naming
from pdserve.testing.k8s_real.cluster import (
    ROOT,
    OperatorProcess,
    RealCluster,
    conditions,
    is_ready,
    llmservice,
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


LIMITED_NS, LIMITED = "llm-a", "limited"


def _limited_service(c: RealCluster) -> None:
    """Two router replicas with per-key limits, the model from a shared Hugging Face cache."""
    cache = read_only_pvc("hf-cache", "1Gi")
    cache["spec"]["accessModes"] = ["ReadWriteMany"]
    c.apply_object(LIMITED_NS, cache)
    hf = {"id": "HuggingFaceTB/SmolLM2-135M-Instruct", "cache": {"claimName": "hf-cache"}}
    limits = {"requestsPerMinute": 120, "maxConcurrencyPerKey": 4}
    obj = llmservice(LIMITED, LIMITED_NS, router={"replicas": 2, "limits": limits})
    obj["spec"]["model"] = {"source": {"huggingFace": hf}}
    c.apply_object(LIMITED_NS, obj)


def _check_budget_peers(c: RealCluster) -> None:
    """The objects the API server stored (its defaults and pruning applied) still carry
    what ``--budget-peers kubernetes`` needs; the emulator tier checks the rendering."""
    ns, name = LIMITED_NS, LIMITED
    deps = f"/apis/apps/v1/namespaces/{ns}/deployments"
    dep = c.wait(lambda: c.get(f"{deps}/{name}-router"), 30, what="the router Deployment")
    pod = dep["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    cmd = router["command"]
    assert cmd[cmd.index("--budget-peers") + 1] == "kubernetes", cmd
    assert cmd[cmd.index("--rate-limit-rpm") + 1] == "120"
    assert cmd[cmd.index("--max-concurrency-per-key") + 1] == "4"
    env = {e["name"]: e for e in router["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", env["POD_IP"]
    (cache,) = [m for m in router["volumeMounts"] if m["mountPath"] == naming.COMPILE_CACHE_MOUNT]
    assert cache.get("readOnly") is True and cache["subPath"] == f".pdserve-compiled/{name}"
    (vol,) = [v for v in pod["volumes"] if v["name"] == cache["name"]]
    assert vol["persistentVolumeClaim"]["claimName"] == "hf-cache"
    workers = [c.get(f"{deps}/{name}-{role}") or {} for role in ("prefill", "decode")]
    for worker in workers:  # they write the folder the router only reads
        (mount,) = [
            m
            for m in worker["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            if m["mountPath"] == naming.COMPILE_CACHE_MOUNT
        ]
        assert not mount.get("readOnly"), mount
    policies = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
    policy = c.get(f"{policies}/{name}-router")
    assert policy is not None
    spec = policy["spec"]
    (admin,) = [r for r in spec["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 8083}]]
    (own,) = [peer for peer in admin["from"] if "namespaceSelector" not in peer]
    labels = own["podSelector"]["matchLabels"]
    assert labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # The rule selects exactly the service's router pods the controllers made.
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    pods = f"/api/v1/namespaces/{ns}/pods"

    def both() -> list[dict[str, Any]] | None:
        got = c.items(pods, selector)
        return got if len(got) == 2 else None

    found = c.wait(both, 30, what="the two router pods the admin rule admits")
    assert {p["metadata"]["labels"]["pdserve.io/role"] for p in found} == {"router"}


def test_examples_apply_reconcile_and_become_ready(
    chart: RealCluster, operator: OperatorProcess
) -> None:
    c = chart
    _gpu_prerequisites(c)
    _limited_service(c)  # reconciled while the examples are
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
    _check_budget_peers(c)
