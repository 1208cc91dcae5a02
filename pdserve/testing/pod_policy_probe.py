"""Issue 44's merged pod policy probe: podTemplates that pass the field checks but unset,
through the merge, the hardening the operator rendered (``drop: []``, nulls, an unhardened
sidecar). tests/k8s/test_k8s_pod_policy.py holds it to 0; bench/chaos_isolation.py reports
it as ``merged_pod_policy_escapes``."""

from __future__ import annotations

from typing import Any

from pdserve.operator.pod_policy import PodPolicy
from pdserve.operator.render import render
from pdserve.operator.spec import SpecError
from pdserve.testing.k8s_objects import TEST_POD_POLICY, minimal_llmservice

STRICT = TEST_POD_POLICY  # minimal_llmservice's weights
D = "spec.decode.podTemplate.spec"
C0 = f"{D}.containers[0].securityContext"


def containers(**fields: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "decode", **fields}]}}


def security_context(field: str, value: Any) -> tuple[dict[str, Any], str]:
    """A decode podTemplate setting ``field`` of the container's securityContext to
    ``value``, and the field the refusal names."""
    return containers(securityContext={field: value}), f"{C0}.{field}"


# (decode podTemplate, the field the refusal names)
MERGED_ESCAPES: dict[str, tuple[dict[str, Any], str]] = {
    "drop [] replaces drop [ALL]": (
        containers(securityContext={"capabilities": {"drop": []}}),
        f"{C0}.capabilities.drop",
    ),
    "null runAsNonRoot": security_context("runAsNonRoot", None),
    "null allowPrivilegeEscalation": security_context("allowPrivilegeEscalation", None),
    "null readOnlyRootFilesystem": security_context("readOnlyRootFilesystem", None),
    "null container securityContext": (containers(securityContext=None), C0),
    "null pod securityContext": ({"spec": {"securityContext": None}}, f"{D}.securityContext"),
    "null seccomp profile": (
        {"spec": {"securityContext": {"seccompProfile": None}}},
        f"{D}.securityContext.seccompProfile",
    ),
    "a sidecar left unhardened": (
        {"spec": {"containers": [{"name": "side", "image": "busybox"}]}},
        f"{D}.containers[1].securityContext",
    ),
}


def merged_escapes(policy: PodPolicy = STRICT) -> int:
    """How many MERGED_ESCAPES the policy lets through (bench/chaos.py reports it)."""
    escaped = 0
    for template, _ in MERGED_ESCAPES.values():
        try:
            render(minimal_llmservice(decode={"podTemplate": template}), policy=policy)
            escaped += 1
        except SpecError:
            pass
    return escaped
