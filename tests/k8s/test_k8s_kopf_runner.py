"""Smoke test through kopf's own CLI (``kopf run -m pdserve.operator.kopf_entry``) via KopfRunner.

KopfRunner runs the operator in a thread with its own event loop; the emulated
API server stays in the test's loop, so the test only ever awaits (never blocks).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from k8s_helpers import NS, eventually, minimal_llmservice, simulate_deployment_controller
from kopf.testing import KopfRunner

from pdserve.operator.kube import KubeClient

pytestmark = pytest.mark.timeout(90)
GVK = ("pdserve.io/v1alpha1", "LLMService")


async def test_kopf_runner_smoke(
    kubeconfig: str, client: KubeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_OPERATOR_STATUS_INTERVAL", "0.3")
    args = ["run", "--standalone", "--namespace", NS, "-m", "pdserve.operator.kopf_entry"]
    runner = KopfRunner(args, timeout=30)
    runner.__enter__()
    try:
        await client.create(minimal_llmservice("smoke"))
        await eventually(
            lambda: client.get("apps/v1", "Deployment", NS, "smoke-router"), what="router"
        )
        await simulate_deployment_controller(client, "smoke")

        async def ready() -> Any:
            obj = await client.get(*GVK, NS, "smoke")
            conds = {
                c["type"]: c["status"] for c in (obj or {}).get("status", {}).get("conditions", [])
            }
            return conds.get("Ready") == "True"

        await eventually(ready, what="Ready=True")
        await client.delete(*GVK, NS, "smoke")

        async def gone() -> bool:
            return await client.get(*GVK, NS, "smoke") is None

        await eventually(gone, what="LLMService deleted (finalizer released)")
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    assert "Handler 'register.<locals>.created' succeeded" in runner.output
