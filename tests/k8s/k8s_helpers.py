"""Helpers shared by the Kubernetes tests (CRD access, sample objects, polling)."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import yaml

from pdserve.operator.kube import KubeClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "charts" / "pdserve" / "crds" / "llmservices.pdserve.io.yaml"
NS = "default"


def load_crd() -> dict[str, Any]:
    with open(CRD_PATH, encoding="utf-8") as f:
        crd: dict[str, Any] = yaml.safe_load(f)
    return crd


def crd_schema() -> dict[str, Any]:
    schema: dict[str, Any] = load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def minimal_llmservice(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"source": {"hostPath": {"path": "/data/models/tiny"}}}}
    body.update(spec)
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": NS},
        "spec": body,
    }


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 15.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns a truthy value; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def simulate_deployment_controller(client: KubeClient, name: str) -> None:
    """What the Deployment controller + kubelet would do: all desired replicas updated and ready."""
    for role in ("router", "prefill", "decode"):
        dep = await client.get("apps/v1", "Deployment", NS, f"{name}-{role}")
        assert dep is not None, f"Deployment {name}-{role} missing"
        n = dep["spec"]["replicas"]
        status = {"replicas": n, "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}
        await client.patch(
            "apps/v1", "Deployment", NS, f"{name}-{role}", {"status": status}, status=True
        )
