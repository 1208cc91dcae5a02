"""The operator (real kopf, in-process) against the emulated API server.

Create → every child with the right image, command, labels, resources and owner
reference; Ready once the (simulated) Deployments are ready. Update → only the
changed children change. Manual edits are reverted, autoscaled replicas kept.
Delete → finalizer removed, nothing left that owner references would not collect.
"""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import NS, eventually, minimal_llmservice, simulate_deployment_controller

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
        assert [(r["kind"], r["name"], r["uid"]) for r in refs] == [("LLMService", "demo", uid)], key
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
    decode_cmd = kids["Deployment/demo-decode"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert decode_cmd[:2] == ["pdserve", "decode-worker"]

    # Not ready until the Deployment controller (simulated) reports ready replicas.
    llm = await eventually(
        lambda: _with_condition(client, "Ready", "False", "ReplicasNotReady"), what="not ready"
    )
    assert llm["status"]["prefill"]["summary"] == "0/2"
    assert llm["status"]["router"]["summary"] == "0/1"
    await simulate_deployment_controller(client, "demo")
    llm = await eventually(lambda: _with_condition(client, "Ready", "True"), what="Ready=True")
    assert llm["status"]["prefill"] == {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 2, "summary": "2/2"}
    assert llm["status"]["decode"]["summary"] == "2/2"
    assert llm["status"]["endpoint"] == "http://demo.default.svc/v1"
    assert llm["status"]["observedGeneration"] == llm["metadata"]["generation"]
    assert condition(llm, "Degraded")["status"] == "False"


async def _with_condition(
    client: KubeClient, type_: str, status: str, reason: str = ""
) -> dict[str, Any] | None:
    obj = await get_llm(client)
    c = condition(obj, type_)
    return obj if c.get("status") == status and reason in ("", c.get("reason")) else None


async def _with_status(client: KubeClient, pool: str, summary: str) -> dict[str, Any] | None:
    obj = await get_llm(client)
    return obj if obj.get("status", {}).get(pool, {}).get("summary") == summary else None
