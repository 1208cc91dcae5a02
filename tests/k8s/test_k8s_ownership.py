"""Children over time (real kopf against the emulator): names that cannot collide, objects
owned by someone else refused (never taken over), a 422 from the API server as a permanent
Degraded carrying its message, and the per-service Secret that is created once.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from k8s_helpers import NS, eventually, minimal_llmservice

from pdserve.operator.kube import KubeClient
from pdserve.operator.render import render

pytestmark = pytest.mark.timeout(60)
GVK = ("pdserve.io/v1alpha1", "LLMService")


async def degraded(client: KubeClient, name: str, reason: str) -> dict[str, Any] | None:
    obj = await client.get(*GVK, NS, name)
    for c in (obj or {}).get("status", {}).get("conditions", []):
        if c["type"] == "Degraded" and c["status"] == "True" and c["reason"] == reason:
            return dict(c)
    return None


async def healthy(client: KubeClient, name: str) -> bool:
    obj = await client.get(*GVK, NS, name)
    conds = {c["type"]: c for c in (obj or {}).get("status", {}).get("conditions", [])}
    return conds.get("Degraded", {}).get("status") == "False"


def test_child_names_of_two_services_never_collide() -> None:
    # "chat-prefill" is refused as a name, so no other LLMService can render chat's children.
    names = {(m["kind"], m["metadata"]["name"]) for m in render(minimal_llmservice("chat"))}
    other = {(m["kind"], m["metadata"]["name"]) for m in render(minimal_llmservice("chat-x"))}
    assert names.isdisjoint(other)


async def test_reserved_name_refused_and_neighbour_untouched(
    operator: None, client: KubeClient
) -> None:
    await client.create(minimal_llmservice("chat"))
    await eventually(lambda: healthy(client, "chat"), what="chat applied")
    before = await client.get("v1", "Service", NS, "chat-prefill")
    assert before is not None
    # The emulator does not run the CRD's CEL rule; the operator refuses the name itself.
    await client.create(minimal_llmservice("chat-prefill"))
    cond = await eventually(lambda: degraded(client, "chat-prefill", "InvalidSpec"), what="refused")
    assert "metadata.name: must not end in -prefill" in cond["message"]
    after = await client.get("v1", "Service", NS, "chat-prefill")
    assert after is not None
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert await client.get("apps/v1", "Deployment", NS, "chat-prefill-router") is None


async def test_foreign_object_is_refused_then_adopted_once_gone(
    operator: None, client: KubeClient
) -> None:
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo-prefill", "namespace": NS, "labels": {"team": "other"}},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 9000}]},
    }
    await client.create(foreign)
    await client.create(minimal_llmservice("demo"))
    cond = await eventually(lambda: degraded(client, "demo", "ForeignChild"), what="Degraded")
    assert "Service/demo-prefill already exists" in cond["message"]
    live = await client.get("v1", "Service", NS, "demo-prefill")
    assert live is not None and live["spec"]["selector"] == {"app": "theirs"}  # not taken over
    assert "ownerReferences" not in live["metadata"]

    await client.delete("v1", "Service", NS, "demo-prefill")  # its owner removes it: we recover
    await eventually(lambda: healthy(client, "demo"), what="Degraded cleared")
    ours = await client.get("v1", "Service", NS, "demo-prefill")
    assert ours is not None and ours["metadata"]["ownerReferences"][0]["name"] == "demo"


async def test_api_server_422_is_permanent_and_degraded_carries_its_message(
    operator: None, client: KubeClient, api_server: Any
) -> None:
    obj = minimal_llmservice("bad", decode={"nodeSelector": {"gpu": "has spaces"}})
    await client.create(obj)
    cond = await eventually(lambda: degraded(client, "bad", "ChildRejected"), what="422")
    assert cond["message"].startswith("Deployment/bad-decode refused by the API server:")
    assert 'Invalid value: "has spaces"' in cond["message"]
    posts = api_server.requests[("POST", False)]
    await asyncio.sleep(1.5)  # three retry delays (0.5 s) of a TemporaryError
    assert api_server.requests[("POST", False)] <= posts + 1  # permanent: no retry loop

    await client.patch(*GVK, NS, "bad", {"spec": {"decode": {"nodeSelector": {"gpu": "h100"}}}})
    await eventually(lambda: healthy(client, "bad"), what="fixed by an edit")
    assert await client.get("apps/v1", "Deployment", NS, "bad-decode") is not None


async def test_service_secret_created_once_and_injected(
    start_operator: Any, client: KubeClient
) -> None:
    async with start_operator():
        await client.create(minimal_llmservice("demo"))
        secret = await eventually(
            lambda: client.get("v1", "Secret", NS, "demo-secret"), what="service Secret"
        )
        value = base64.b64decode(secret["data"]["secret"])
        assert len(value) >= 32
        assert secret["metadata"]["ownerReferences"][0]["name"] == "demo"
        await client.patch(*GVK, NS, "demo", {"spec": {"slo": {"ttftMs": 250}}})
        await eventually(lambda: _generation(client, 2), what="generation 2 applied")
    async with start_operator():  # a restart (resume) must not regenerate it either
        await eventually(lambda: healthy(client, "demo"), what="resumed")
        again = await client.get("v1", "Secret", NS, "demo-secret")
        assert again is not None and base64.b64decode(again["data"]["secret"]) == value
    for role in ("router", "prefill", "decode"):
        dep = await client.get("apps/v1", "Deployment", NS, f"demo-{role}")
        assert dep is not None
        env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["PDSERVE_SERVICE_SECRET"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "demo-secret", "key": "secret"}, role
        # Rotation's second secret and the prefix cache's hash key: optional entries.
        for var, key in (
            ("PDSERVE_SERVICE_SECRET_ACCEPTED", "accepted"),
            ("PDSERVE_BLOCK_HASH_KEY", "hash-key"),
        ):
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "demo-secret", "key": key, "optional": True}, (role, var)
    assert len(base64.b64decode(secret["data"]["hash-key"])) >= 32  # its own, not the secret
    assert secret["data"]["hash-key"] != secret["data"]["secret"]


async def _generation(client: KubeClient, generation: int) -> bool:
    obj = await client.get(*GVK, NS, "demo")
    return (obj or {}).get("status", {}).get("observedGeneration") == generation
