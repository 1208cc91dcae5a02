"""Schema-valid but unusable specs: Degraded with a message naming the field, no half-built service.

A missing PVC may still be created (TemporaryError: the operator retries
and recovers); a spec that fights the operator needs an edit (PermanentError).
Also: the autoscaler's write path (``scale_pools``) and its refusal when disabled.
"""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import NS, eventually, minimal_llmservice, schema_errors

from pdserve.operator.kube import KubeClient, KubeError
from pdserve.operator.render import render
from pdserve.operator.scaling import ScalingRefused, scale_pools
from pdserve.testing.k8s_emulator import ApiServer

pytestmark = pytest.mark.timeout(60)
GVK = ("pdserve.io/v1alpha1", "LLMService")


async def degraded(client: KubeClient, name: str) -> dict[str, Any] | None:
    obj = await client.get(*GVK, NS, name)
    assert obj is not None
    for c in obj.get("status", {}).get("conditions", []):
        if c["type"] == "Degraded" and c["status"] == "True":
            return dict(c)
    return None


async def existing_children(client: KubeClient, obj: dict[str, Any]) -> list[str]:
    out = []
    for m in render(obj):
        if await client.get(m["apiVersion"], m["kind"], NS, m["metadata"]["name"]) is not None:
            out.append(f"{m['kind']}/{m['metadata']['name']}")
    return out


CASES = {
    "missing PVC": (
        {"model": {"source": {"pvc": {"claimName": "weights", "path": "llama"}}}},
        'spec.model.source.pvc.claimName: PersistentVolumeClaim "weights" not found',
    ),
    "missing model cache PVC": (
        {"model": {"source": {"huggingFace": {"id": "org/m", "cache": {"claimName": "hf"}}}}},
        'spec.model.source.huggingFace.cache.claimName: PersistentVolumeClaim "hf" not found',
    ),
    "operator-managed flag in extraArgs": (
        {"decode": {"extraArgs": ["--max-num-seqs", "64", "--port=9000"]}},
        "spec.decode.extraArgs[2]: --port is set by the operator",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_invalid_spec_is_degraded_without_children(
    case: str, operator: None, client: KubeClient
) -> None:
    spec, message = CASES[case]
    obj = minimal_llmservice("bad", **spec)
    assert schema_errors(obj) == [], "these specs pass the schema: only the operator can tell"
    await client.create(obj)
    cond = await eventually(lambda: degraded(client, "bad"), what="Degraded=True")
    assert cond["reason"] == "InvalidSpec"
    assert message in cond["message"]
    assert await existing_children(client, obj) == []  # no half-built service


async def test_the_operator_never_reads_a_secret(
    operator: None, client: KubeClient, api_server: ApiServer
) -> None:
    """Issue 44 item 12: the chart grants ``create`` on Secrets alone, so no operator path
    may get, list or watch one. An LLMService naming an api-key Secret and an HF token
    Secret that do not exist yet is built (the pods that mount them wait, with the
    kubelet's Event naming the Secret); the operator's only Secret request is the create
    of its own per-service secret. Before: a get of each (preflight, and the service
    secret's existence check), and Degraded until the Secret appeared."""
    source = {"huggingFace": {"id": "org/model", "tokenSecret": {"name": "hf"}}}
    router = {"apiKeySecret": {"name": "llm-key", "key": "token"}}
    obj = minimal_llmservice("keyed", router=router, model={"source": source})
    await client.create(obj)

    async def built() -> Any:
        return await degraded(client, "keyed") is None and len(
            await existing_children(client, obj)
        ) == len(render(obj))

    await eventually(built, what="children without the Secrets")
    ours = await client.get("v1", "Secret", NS, "keyed-secret")  # the test's own read
    assert ours is not None and ours["metadata"]["ownerReferences"][0]["name"] == "keyed"
    router_dep = await client.get("apps/v1", "Deployment", NS, "keyed-router")
    assert router_dep is not None
    cmd = router_dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--api-key-file") + 1] == "/etc/pdserve/api-key/token"
    await client.patch(*GVK, NS, "keyed", {"spec": {"router": {"replicas": 2}}})
    await eventually(lambda: _replicas(client, "keyed-router", 2), what="a second reconcile")
    secret_calls = {k: v for k, v in api_server.by_method_resource.items() if k[1] == "secrets"}
    gets = {k: v for k, v in secret_calls.items() if k[0] != "POST"}
    # the test's own get above is the one GET (the operator's client is the same class:
    # count it out)
    assert gets == {("GET", "secrets"): 1}, secret_calls
    assert secret_calls[("POST", "secrets")] >= 2  # the create, then a 409 each reconcile


async def _replicas(client: KubeClient, name: str, n: int) -> bool:
    dep = await client.get("apps/v1", "Deployment", NS, name)
    return dep is not None and dep["spec"].get("replicas") == n


async def test_scale_pools_seam(
    operator: None, client: KubeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = minimal_llmservice("auto", autoscaling={"enabled": True}, decode={"maxReplicas": 3})
    await client.create(obj)
    await eventually(lambda: client.get("apps/v1", "Deployment", NS, "auto-decode"), what="decode")
    writes = _spy_writes(client, monkeypatch)
    result = await scale_pools(
        client, NS, "auto", prefill=2, decode=10, reason="ttft p90 above SLO"
    )
    assert (result.prefill, result.decode) == (2, 3)  # decode clamped to maxReplicas
    # through each Deployment's /scale (what RBAC's deployments/scale grants), no spec patch
    assert [w for w in writes if w[1] == "Deployment"] == [
        ("scale", "Deployment", "auto-prefill", 2),
        ("scale", "Deployment", "auto-decode", 3),
    ]
    scale = await client.scale("apps/v1", "Deployment", NS, "auto-decode", 3)
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 3}, scale
    with pytest.raises(KubeError, match=r"Scale\.spec\.replicas"):
        await client.scale("apps/v1", "Deployment", NS, "auto-decode", -1)
    assert set(result.changed) == {"Deployment/auto-prefill", "Deployment/auto-decode"}
    llm = await client.get(*GVK, NS, "auto")
    assert llm is not None
    decision = llm["status"]["autoscaling"]["lastDecision"]
    assert decision["prefillReplicas"] == 2 and decision["decodeReplicas"] == 3
    assert decision["reason"] == "ttft p90 above SLO" and decision["time"].endswith("Z")
    again = await scale_pools(client, NS, "auto", prefill=2, decode=3, reason="steady")
    assert again.changed == ()  # only changed Deployments are patched

    await client.patch(*GVK, NS, "auto", {"spec": {"autoscaling": {"enabled": False}}})
    with pytest.raises(ScalingRefused, match=r"spec.autoscaling.enabled is false"):
        await scale_pools(client, NS, "auto", prefill=1, decode=1, reason="x")
    # With autoscaling off the spec wins again: the operator restores spec replicas (1).
    dep = await eventually(
        lambda: _replicas(client, "auto-decode", 1), what="spec replicas restored"
    )
    assert dep["spec"]["replicas"] == 1


async def _replicas(client: KubeClient, name: str, n: int) -> dict[str, Any] | None:
    dep = await client.get("apps/v1", "Deployment", NS, name)
    return dep if dep is not None and dep["spec"]["replicas"] == n else None


def _spy_writes(client: KubeClient, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """(verb, kind, name, replicas or patch) of every patch and scale ``client`` sends."""
    writes: list[tuple[Any, ...]] = []
    patch, scale = client.patch, client.scale

    async def patched(api: str, kind: str, ns: str, name: str, body: Any, **kw: Any) -> Any:
        writes.append(("patch", kind, name, body))
        return await patch(api, kind, ns, name, body, **kw)

    async def scaled(api: str, kind: str, ns: str, name: str, replicas: int) -> Any:
        writes.append(("scale", kind, name, replicas))
        return await scale(api, kind, ns, name, replicas)

    monkeypatch.setattr(client, "patch", patched)
    monkeypatch.setattr(client, "scale", scaled)
    return writes
