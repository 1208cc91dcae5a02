"""Helpers shared by the Kubernetes tests (CRD access, sample objects, polling)."""

from __future__ import annotations

import asyncio
import copy
import functools
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

from pdserve.operator.kube import KubeClient
from pdserve.testing.k8s_objects import NS as NS
from pdserve.testing.k8s_objects import TEST_POD_POLICY as TEST_POD_POLICY
from pdserve.testing.k8s_objects import minimal_llmservice as minimal_llmservice

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "charts" / "pdserve" / "crds" / "llmservices.pdserve.io.yaml"


def load_crd() -> dict[str, Any]:
    with open(CRD_PATH, encoding="utf-8") as f:
        crd: dict[str, Any] = yaml.safe_load(f)
    return crd


def crd_schema() -> dict[str, Any]:
    schema: dict[str, Any] = load_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


async def eventually(
    check: Callable[[], Awaitable[Any]], timeout: float = 30.0, what: str = "condition"
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
        # The operator creates the three in its own order: a caller that waited for one
        # (say decode) may be here before another exists (seen under load: router missing).
        dep = await eventually(
            functools.partial(client.get, "apps/v1", "Deployment", NS, f"{name}-{role}"),
            what=f"Deployment {name}-{role}",
        )
        n = dep["spec"]["replicas"]
        status = {"replicas": n, "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n}
        await client.patch(
            "apps/v1", "Deployment", NS, f"{name}-{role}", {"status": status}, status=True
        )


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Apply ``default``s the way the API server does for a structural schema (in place)."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_schema_defaults(sub, value[key])
    if isinstance(value, list) and "items" in schema:
        for item in value:
            apply_schema_defaults(schema["items"], item)
    return value


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Evaluate every ``x-kubernetes-validations`` CEL rule at its place in ``value`` (celpy)."""
    env = celpy.Environment()
    errors = []
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += cel_errors(sub, value[key], f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would refuse: OpenAPI v3.0 schema (Draft 4 semantics) + CEL rules."""
    schema = crd_schema()
    obj = apply_schema_defaults(schema, copy.deepcopy(obj))
    validator = jsonschema.Draft4Validator(schema)
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]
    return errors or cel_errors(schema, obj)
