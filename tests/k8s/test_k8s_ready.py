"""Ready means serving, over time, and status follows watch events (no polling timer).

The resync safety net is set to an hour here, so every status change below can only
come from a watch event on a Deployment.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import running_operator
from k8s_helpers import NS, eventually, minimal_llmservice, simulate_deployment_controller

from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.kube import KubeClient

pytestmark = pytest.mark.timeout(60)
GVK = ("pdserve.io/v1alpha1", "LLMService")


async def conditions(client: KubeClient) -> dict[str, tuple[str, str]]:
    obj = await client.get(*GVK, NS, "demo")
    return {
        c["type"]: (c["status"], c["reason"])
        for c in (obj or {}).get("status", {}).get("conditions", [])
    }


async def set_status(client: KubeClient, role: str, **status: int) -> None:
    await client.patch("apps/v1", "Deployment", NS, f"demo-{role}", {"status": status}, status=True)


async def test_scale_up_keeps_ready_and_sets_progressing(
    kubeconfig: str, client: KubeClient
) -> None:
    config = OperatorConfig(status_interval=3600, retry_delay=0.5, debounce=0.05)
    async with running_operator(config):
        await client.create(minimal_llmservice("demo"))
        await eventually(lambda: client.get("apps/v1", "Deployment", NS, "demo-decode"))
        await simulate_deployment_controller(client, "demo")

        async def is_(ready: tuple[str, str], progressing: str) -> Any:
            c = await conditions(client)
            return c.get("Ready") == ready and c.get("Progressing", ("",))[0] == progressing

        await eventually(lambda: is_(("True", "Serving"), "False"), what="Ready, stable")
        # Scale decode to 3: one ready, two loading (a model load may take many minutes).
        await client.patch(*GVK, NS, "demo", {"spec": {"decode": {"replicas": 3}}})
        await eventually(lambda: _replicas(client, 3), what="decode scaled")
        await set_status(client, "decode", replicas=3, updatedReplicas=3, readyReplicas=1)
        await eventually(lambda: is_(("True", "Serving"), "True"), what="Ready while scaling")
        # The last decode replica becomes unready: the service cannot serve.
        await set_status(client, "decode", replicas=3, updatedReplicas=3, readyReplicas=0)
        await eventually(lambda: is_(("False", "NotServing"), "True"), what="NotServing")
        obj = await client.get(*GVK, NS, "demo")
        ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
        assert ready["message"] == "no ready replica in: decode"
        await set_status(client, "decode", replicas=3, updatedReplicas=3, readyReplicas=3)
        await eventually(lambda: is_(("True", "Serving"), "False"), what="settled")


async def _replicas(client: KubeClient, n: int) -> bool:
    dep = await client.get("apps/v1", "Deployment", NS, "demo-decode")
    return bool(dep and dep["spec"]["replicas"] == n)
