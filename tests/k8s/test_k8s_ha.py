"""High availability: two operator replicas with kopf peering against the emulator.

The replica with the higher priority is active, the other stands by (kopf pauses it).
Each replica renders a different default image, so the children show who reconciled
them. Stopping the active one hands over within seconds: the standby resumes, repairs
the children to its own rendering and handles new objects.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from k8s_helpers import NS, TEST_POD_POLICY, eventually, minimal_llmservice

from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.kube import KubeClient
from pdserve.testing.operator_replica import OperatorReplica

pytestmark = pytest.mark.timeout(90)
PEERING = "pdserve"


def config(image: str) -> OperatorConfig:
    return OperatorConfig(
        status_interval=0.3,
        retry_delay=0.5,
        debounce=0.05,
        default_image=image,
        peering_lifetime=10,  # keep-alives every 1-5 s: a loaded CI box never looks dead
        pod_policy=TEST_POD_POLICY,
    )


async def router_image(client: KubeClient, name: str) -> str:
    dep = await client.get("apps/v1", "Deployment", NS, f"{name}-router")
    return str(dep["spec"]["template"]["spec"]["containers"][0]["image"]) if dep else ""


async def peers(client: KubeClient) -> dict[str, Any]:
    obj = await client.get("kopf.dev/v1", "KopfPeering", NS, PEERING)
    return dict((obj or {}).get("status") or {})


def replica(image: str, priority: int) -> OperatorReplica:
    """A replica whose children show ``image``: who reconciled them."""
    return OperatorReplica(config(image), priority, PEERING, NS)


async def test_standby_takes_over_when_the_active_replica_stops(
    kubeconfig: str, client: KubeClient
) -> None:
    peering = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": PEERING, "namespace": NS},
    }
    await client.create(peering)
    # The active replica registers first, so the standby's first look at the peering
    # already shows it: kopf holds a replica paused until that first look, and one that
    # saw only itself would act until its watch caught up (a race this test once lost).
    async with replica("active:1", priority=20) as active:
        await eventually(lambda: _count(peers(client), 1), 15, "the active replica registered")
        async with replica("standby:1", priority=10):
            await _takeover(client, active)


async def _takeover(client: KubeClient, active: OperatorReplica) -> None:
    await eventually(lambda: _count(peers(client), 2), 15, "both replicas registered")
    await client.create(minimal_llmservice("one"))
    await eventually(lambda: _is(router_image(client, "one"), "active:1"), 20, "active")
    await asyncio.sleep(1.0)
    assert await router_image(client, "one") == "active:1"  # the standby stays idle
    await asyncio.to_thread(active.close)  # the active replica's pod stops
    started = time.monotonic()
    await eventually(lambda: _is(router_image(client, "one"), "standby:1"), 15, "standby took over")
    takeover_s = time.monotonic() - started
    await client.create(minimal_llmservice("two"))
    await eventually(lambda: _is(router_image(client, "two"), "standby:1"), 15, "new object")
    assert takeover_s < 10, f"takeover took {takeover_s:.1f}s"


async def _count(peers_coro: Any, n: int) -> bool:
    return len(await peers_coro) >= n


async def _is(value_coro: Any, expected: str) -> bool:
    return bool(await value_coro == expected)
