"""Smoke tests of the shipped entry points: ``kopf run -m pdserve.operator.kopf_entry``
through kopf's KopfRunner, and ``pdserve operator`` as a real process.

KopfRunner runs the operator in a thread with its own event loop; the emulated
API server stays in the test's loop, so the test only ever awaits (never blocks).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import sys
from typing import Any

import aiohttp
import pytest
from k8s_helpers import NS, ROOT, eventually, minimal_llmservice, simulate_deployment_controller
from kopf.testing import KopfRunner

from pdserve.operator.kube import KubeClient
from pdserve.testing.loopback import free_port

pytestmark = pytest.mark.timeout(90)


def _pdserve() -> str:
    """The checkout's venv (scripts/setup.sh), else the one this interpreter runs in."""
    local = ROOT / ".venv" / "bin" / "pdserve"
    return str(local) if local.exists() else str(pathlib.Path(sys.executable).parent / "pdserve")


GVK = ("pdserve.io/v1alpha1", "LLMService")


async def test_kopf_runner_smoke(
    kubeconfig: str, client: KubeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_OPERATOR_STATUS_INTERVAL", "0.3")
    monkeypatch.setenv("PDSERVE_OPERATOR_MODEL_HOST_PATHS", "/data/models")  # minimal_llmservice
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

        await eventually(gone, what="LLMService deleted (no finalizer to release)")
    finally:
        await asyncio.to_thread(runner.__exit__, None, None, None)
    assert runner.exit_code == 0, runner.output
    assert runner.exception is None
    assert "Handler 'register.<locals>.created' succeeded" in runner.output


async def test_pdserve_operator_process(kubeconfig: str, client: KubeClient) -> None:
    """The shipped entry point, ``pdserve operator``, as a real process: reconciles, answers
    its liveness probe, and stops cleanly on SIGTERM."""
    port = free_port()
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    proc = await asyncio.create_subprocess_exec(
        _pdserve(),
        "operator",
        "--namespace",
        NS,
        "--status-interval",
        "0.3",
        "--health-port",
        str(port),
        "--allow-model-host-path",
        "/data/models",  # minimal_llmservice's weights
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await client.create(minimal_llmservice("proc"))
        await eventually(
            lambda: client.get("apps/v1", "Deployment", NS, "proc-decode"), 30, "decode"
        )

        async def healthy() -> bool:
            try:
                async with (
                    aiohttp.ClientSession() as s,
                    s.get(f"http://127.0.0.1:{port}/healthz") as r,
                ):
                    return r.status == 200
            except aiohttp.ClientError:
                return False

        await eventually(healthy, 30, "liveness endpoint")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, out.decode()[-3000:]
