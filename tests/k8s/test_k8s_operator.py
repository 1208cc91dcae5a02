"""The operator (real kopf, in-process) against the emulated API server.

Create → every child with the right image, command, labels, resources and owner
reference; Ready once the (simulated) Deployments are ready. Update → only the
changed children change. Manual edits are reverted, autoscaled replicas kept.
Delete → no finalizer; nothing left that owner references would not collect.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from k8s_helpers import (
    NS,
    crd_schema,
    eventually,
    minimal_llmservice,
    schema_errors,
    simulate_deployment_controller,
)

from pdserve.operator.kube import KubeClient
from pdserve.operator.render import render

pytestmark = pytest.mark.timeout(60)

GVK = ("pdserve.io/v1alpha1", "LLMService")


def gpu_service(name: str = "demo") -> dict[str, Any]:
    return minimal_llmservice(
        name,
        image="registry.example.com/pdserve:1.2.3",
        prefill={"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}}},
        decode={"replicas": 2, "maxReplicas": 6, "resources": {"limits": {"nvidia.com/gpu": 1}}},
    )


async def get_llm(client: KubeClient, name: str = "demo") -> dict[str, Any]:
    obj = await client.get(*GVK, NS, name)
    assert obj is not None
    return obj


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == type_:
            return dict(c)
    return {}


async def children(client: KubeClient, obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The live children, keyed Kind/name, for every manifest the rendering names."""
    out = {}
    for m in render(obj):
        live = await client.get(m["apiVersion"], m["kind"], NS, m["metadata"]["name"])
        if live is not None:
            out[f"{m['kind']}/{m['metadata']['name']}"] = live
    return out


async def wait_children(client: KubeClient, obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    want = len(render(obj))

    async def all_there() -> Any:
        got = await children(client, obj)
        return got if len(got) == want else None

    result: dict[str, dict[str, Any]] = await eventually(all_there, what=f"{want} children")
    return result


async def test_create_children_and_ready(operator: None, client: KubeClient) -> None:
    obj = gpu_service()
    await client.create(obj)
    kids = await wait_children(client, obj)
    owner = await get_llm(client)
    uid = owner["metadata"]["uid"]
    for key, child in kids.items():
        refs = child["metadata"].get("ownerReferences", [])
        assert [(r["kind"], r["name"], r["uid"]) for r in refs] == [("LLMService", "demo", uid)], (
            key
        )
        assert refs[0]["controller"] is True and refs[0]["blockOwnerDeletion"] is True
        assert child["metadata"]["labels"]["pdserve.io/service"] == "demo", key
    prefill = kids["Deployment/demo-prefill"]
    pod = prefill["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/pdserve:1.2.3"
    assert container["command"][:3] == ["pdserve", "prefill-worker", "--model"]
    assert container["command"][container["command"].index("--port") + 1] == "8080"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1  # extended: requests == limits
    assert pod["metadata"]["labels"]["pdserve.io/role"] == "prefill"
    assert prefill["spec"]["replicas"] == 2
    router = kids["Deployment/demo-router"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert router[:2] == ["pdserve", "router"]
    assert " ".join(router).count("--discovery kubernetes --service demo --namespace default") == 1
    decode_cmd = kids["Deployment/demo-decode"]["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    assert decode_cmd[:2] == ["pdserve", "decode-worker"]

    # Not ready until the Deployment controller (simulated) reports ready replicas.
    llm = await eventually(
        lambda: _with_condition(client, "Ready", "False", "NotServing"), what="not ready"
    )
    assert llm["status"]["prefill"]["summary"] == "0/2"
    assert llm["status"]["router"]["summary"] == "0/1"
    await simulate_deployment_controller(client, "demo")
    llm = await eventually(lambda: _with_condition(client, "Ready", "True"), what="Ready=True")
    assert llm["status"]["prefill"] == {
        "desiredReplicas": 2,
        "replicas": 2,
        "readyReplicas": 2,
        "summary": "2/2",
    }
    assert llm["status"]["decode"]["summary"] == "2/2"
    assert llm["status"]["endpoint"] == "http://demo.default.svc/v1"
    assert llm["status"]["observedGeneration"] == llm["metadata"]["generation"]
    assert condition(llm, "Degraded")["status"] == "False"
    # The emulator does not prune: check that status carries only fields the CRD declares.
    declared = crd_schema()["properties"]["status"]["properties"]
    assert set(llm["status"]) <= set(declared), set(llm["status"]) - set(declared)
    assert schema_errors({**llm, "metadata": {"name": "demo"}}) == []


async def _with_condition(
    client: KubeClient, type_: str, status: str, reason: str = ""
) -> dict[str, Any] | None:
    obj = await get_llm(client)
    c = condition(obj, type_)
    return obj if c.get("status") == status and reason in ("", c.get("reason")) else None


async def _with_status(client: KubeClient, pool: str, summary: str) -> dict[str, Any] | None:
    obj = await get_llm(client)
    return obj if obj.get("status", {}).get(pool, {}).get("summary") == summary else None


async def versions(client: KubeClient, obj: dict[str, Any]) -> dict[str, str]:
    kids = await children(client, obj)
    return {k: v["metadata"]["resourceVersion"] for k, v in kids.items()}


async def test_update_patches_only_changed_children(operator: None, client: KubeClient) -> None:
    # An exposed service needs API keys (operator/exposure.py): the Ingress below does.
    data = {"api-key": base64.b64encode(b"k1").decode()}
    meta = {"name": "keys", "namespace": NS}
    await client.create({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data})
    obj = gpu_service()
    obj["spec"]["router"] = {"apiKeySecret": {"name": "keys"}}
    await client.create(obj)
    await wait_children(client, obj)
    await eventually(lambda: _generation_applied(client), what="generation 1 applied")
    before = await versions(client, obj)

    await client.patch(*GVK, NS, "demo", {"spec": {"decode": {"replicas": 3}}})
    await eventually(lambda: _generation_applied(client, 2), what="generation 2 applied")
    after = await versions(client, obj)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"Deployment/demo-decode"}
    dep = await client.get("apps/v1", "Deployment", NS, "demo-decode")
    assert dep is not None and dep["spec"]["replicas"] == 3

    # An optional child appears and disappears with its spec field; nothing else is touched.
    await client.patch(
        *GVK, NS, "demo", {"spec": {"router": {"ingress": {"host": "llm.example.com"}}}}
    )
    ing = await eventually(
        lambda: client.get("networking.k8s.io/v1", "Ingress", NS, "demo"), what="Ingress"
    )
    assert ing["spec"]["rules"][0]["host"] == "llm.example.com"
    await eventually(lambda: _generation_applied(client, 3), what="generation 3 applied")
    assert {k for k, v in (await versions(client, obj)).items() if after.get(k, v) != v} == set()
    llm = await eventually(
        lambda: _with_endpoint(client, "http://llm.example.com/v1"), what="endpoint"
    )
    assert llm["status"]["endpoint"] == "http://llm.example.com/v1"
    await client.patch(*GVK, NS, "demo", {"spec": {"router": {"ingress": None}}})
    await eventually(
        lambda: _absent(client, "networking.k8s.io/v1", "Ingress", "demo"), what="Ingress pruned"
    )


async def test_manual_edits_reverted_autoscaled_replicas_kept(
    operator: None, client: KubeClient
) -> None:
    obj = gpu_service()
    obj["spec"]["autoscaling"] = {"enabled": True}
    await client.create(obj)
    await wait_children(client, obj)
    await eventually(lambda: _generation_applied(client), what="generation 1 applied")
    image = "evil.example.com/other:latest"
    edit = {"spec": {"template": {"spec": {"containers": [{"name": "prefill", "image": image}]}}}}
    await client.patch("apps/v1", "Deployment", NS, "demo-prefill", edit)
    await client.patch("apps/v1", "Deployment", NS, "demo-decode", {"spec": {"replicas": 5}})
    await client.patch("apps/v1", "Deployment", NS, "demo-prefill", {"spec": {"replicas": 40}})
    cm_edit = {"data": {"PDSERVE_KV_TRANSPORT": "tcp"}}
    await client.patch("v1", "ConfigMap", NS, "demo-config", cm_edit)

    async def reverted() -> Any:
        dep = await client.get("apps/v1", "Deployment", NS, "demo-prefill")
        cm = await client.get("v1", "ConfigMap", NS, "demo-config")
        assert dep is not None and cm is not None
        c = dep["spec"]["template"]["spec"]["containers"][0]
        ok = c["image"] == obj["spec"]["image"] and cm["data"]["PDSERVE_KV_TRANSPORT"] == "nixl"
        # The image may be reverted by an earlier repair than the one that sees the 40 and
        # clamps it (each edit is its own write), so the wait covers the clamp as well.
        return dep if ok and dep["spec"]["replicas"] == 4 else None

    prefill = await eventually(reverted, what="manual edits reverted, replicas clamped")
    assert prefill["spec"]["replicas"] == 4  # autoscaler's 40 clamped to maxReplicas
    assert prefill["spec"]["template"]["spec"]["containers"][0]["command"][1] == "prefill-worker"
    decode = await client.get("apps/v1", "Deployment", NS, "demo-decode")
    assert decode is not None and decode["spec"]["replicas"] == 5  # within [1, 6]: kept


async def test_no_finalizer_delete_leaves_only_owned(
    operator: None, client: KubeClient, api_server: Any
) -> None:
    """No finalizer, ever: ``helm uninstall`` may stop the operator before the LLMService is
    deleted, and the object must not hang in Terminating. Owner references collect the rest."""
    obj = gpu_service()
    await client.create(obj)
    await wait_children(client, obj)
    llm = await eventually(lambda: _generation_applied(client), what="generation 1 applied")
    llm = await get_llm(client)
    assert llm["metadata"].get("finalizers", []) == []
    uid = llm["metadata"]["uid"]
    await client.delete(*GVK, NS, "demo")
    assert await client.get(*GVK, NS, "demo") is None  # gone at once: nothing to wait for
    # The emulator has no garbage collector: everything left must be collectable by owner refs.
    left = [o for (res, _ns, _name), o in api_server.objects.items() if not o.deleted]
    left = [o for o in left if o["kind"] not in ("LLMService", "Event")]
    assert {o["kind"] for o in left} >= {"Deployment", "Service", "Secret", "ConfigMap"}
    for o in left:
        refs = [r["uid"] for r in o["metadata"].get("ownerReferences", [])]
        assert refs == [uid], f"{o['kind']}/{o['metadata']['name']} not owned by the LLMService"


async def _generation_applied(client: KubeClient, generation: int = 1) -> Any:
    obj = await get_llm(client)
    status = obj.get("status", {})
    return status.get("observedGeneration") == generation == obj["metadata"]["generation"]


async def _with_endpoint(client: KubeClient, endpoint: str) -> dict[str, Any] | None:
    obj = await get_llm(client)
    return obj if obj.get("status", {}).get("endpoint") == endpoint else None


async def _absent(client: KubeClient, api_version: str, kind: str, name: str) -> bool:
    return await client.get(api_version, kind, NS, name) is None


async def test_resume_after_restart_is_idempotent(start_operator: Any, client: KubeClient) -> None:
    obj = gpu_service()
    async with start_operator():
        await client.create(obj)
        await wait_children(client, obj)
        await eventually(lambda: _generation_applied(client), what="generation 1 applied")
    before = await versions(client, obj)
    # While the operator is down: one child drifts, one is deleted by hand.
    await client.patch("v1", "Service", NS, "demo", {"spec": {"type": "NodePort"}})
    await client.delete("policy/v1", "PodDisruptionBudget", NS, "demo-decode")
    drifted = (await versions(client, obj))["Service/demo"]
    async with start_operator():
        await wait_children(client, obj)  # resume re-created the missing PDB

        async def service_restored() -> Any:
            svc = await client.get("v1", "Service", NS, "demo")
            return svc is not None and svc["spec"]["type"] == "ClusterIP"

        await eventually(service_restored, what="Service type reverted")
    after = await versions(client, obj)
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"Service/demo", "PodDisruptionBudget/demo-decode"}
    assert after["Service/demo"] != drifted
