"""``pdserve rotate-secret`` (operator/rotate_secret.py) on the API emulator, with the real
operator having made the service's Secret: three edits, each rolled out to all three
Deployments before the next; the hash key untouched. Which secrets the pods of adjacent
steps hold is what tests/workers/test_signed_calls.py::test_rotation_without_a_failed_call
and tests/transfer/test_kv_frame_auth.py::test_rotation_keeps_kv_moving run for real."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from k8s_helpers import NS, eventually, minimal_llmservice

from pdserve.operator.kube import KubeClient
from pdserve.operator.rotate_secret import (
    RESTARTED_AT,
    RotationError,
    restarter,
    rolled_out,
    rotate,
)
from pdserve.protocol import hashing

pytestmark = pytest.mark.timeout(60)


async def deployment_controller(client: KubeClient) -> None:
    """The emulator has none: every pod of each Deployment's latest generation is ready."""
    while True:
        for role in ("router", "prefill", "decode"):
            dep = await client.get("apps/v1", "Deployment", NS, f"demo-{role}")
            if dep is None:
                continue
            want = dep["spec"]["replicas"]
            status = {
                "observedGeneration": dep["metadata"].get("generation", 0),
                "replicas": want,
                "updatedReplicas": want,
                "readyReplicas": want,
            }
            await client.patch(
                "apps/v1",
                "Deployment",
                NS,
                dep["metadata"]["name"],
                {"status": status},
                status=True,
            )
        await asyncio.sleep(0.05)


def _decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


async def test_three_steps_each_rolled_out(operator: None, client: KubeClient) -> None:
    await client.create(minimal_llmservice("demo"))
    await eventually(lambda: client.get("apps/v1", "Deployment", NS, "demo-router"))
    before = _decoded(await client.get("v1", "Secret", NS, "demo-secret") or {})
    old = before["secret"]
    seen: list[dict[str, str]] = []
    restart = restarter(client, NS, "demo", timeout=10, poll_s=0.05)

    async def roll(label: str) -> None:
        seen.append(_decoded(await client.get("v1", "Secret", NS, "demo-secret") or {}))
        await restart(label)

    controller = asyncio.create_task(deployment_controller(client))
    try:
        await rotate(client, NS, "demo", "new-secret", roll)
    finally:
        controller.cancel()
    hash_key = before["hash-key"]
    assert seen == [
        {"secret": old, "accepted": "new-secret", "hash-key": hash_key},
        {"secret": "new-secret", "accepted": old, "hash-key": hash_key},
        {"secret": "new-secret", "hash-key": hash_key},
    ]
    for role in ("router", "prefill", "decode"):
        dep = await client.get("apps/v1", "Deployment", NS, f"demo-{role}")
        assert dep is not None
        assert RESTARTED_AT in dep["spec"]["template"]["metadata"]["annotations"], role
    with pytest.raises(RotationError, match="not found"):
        await rotate(client, NS, "absent", "x", roll)


async def test_a_rotation_under_way_is_not_restarted(operator: None, client: KubeClient) -> None:
    await client.create(minimal_llmservice("demo"))
    await eventually(lambda: client.get("v1", "Secret", NS, "demo-secret"))
    await client.patch("v1", "Secret", NS, "demo-secret", {"data": {"accepted": "eHl6"}})

    async def roll(_: str) -> None:
        raise AssertionError("must not roll")

    with pytest.raises(RotationError, match="under way"):
        await rotate(client, NS, "demo", "new", roll)


def test_rolled_out_waits_for_the_controller() -> None:
    status = {"observedGeneration": 2, "updatedReplicas": 2, "readyReplicas": 2}
    dep: dict[str, Any] = {"metadata": {"generation": 3}, "spec": {"replicas": 2}, "status": status}
    assert not rolled_out(dep)  # the new template not seen yet
    dep["status"].update(observedGeneration=3, updatedReplicas=1)
    assert not rolled_out(dep)
    dep["status"].update(updatedReplicas=2, unavailableReplicas=1)
    assert not rolled_out(dep)
    dep["status"].pop("unavailableReplicas")
    assert rolled_out(dep)


async def test_a_rotation_keeps_an_old_secrets_block_hash(
    client: KubeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rotating a Secret from before ``hash-key`` existed (issue 44 item 14) would change
    every pod's block hash (derived from the secret without the entry): the rotation
    patches the old secret in as the hash key before its first step."""
    data = {"secret": base64.b64encode(b"old-secret").decode()}
    meta = {"name": "demo-secret", "namespace": NS}
    await client.create({"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": data})
    seen: list[dict[str, str]] = []

    async def roll(_: str) -> None:
        seen.append(_decoded(await client.get("v1", "Secret", NS, "demo-secret") or {}))

    await rotate(client, NS, "demo", "new-secret", roll)
    assert [s["hash-key"] for s in seen] == ["old-secret"] * 3
    assert seen[-1]["secret"] == "new-secret"
    # A pod before the rotation (the secret only) and one after (new secret, the hash key)
    # hash with the same key (protocol/hashing.py).
    monkeypatch.delenv("PDSERVE_BLOCK_HASH_KEY", raising=False)
    monkeypatch.setenv("PDSERVE_SERVICE_SECRET", "old-secret")
    before = hashing.hash_key()
    monkeypatch.setenv("PDSERVE_SERVICE_SECRET", "new-secret")
    monkeypatch.setenv("PDSERVE_BLOCK_HASH_KEY", seen[-1]["hash-key"])
    assert hashing.hash_key() == before != b""
