"""An LLMService is not a pod factory: podTemplate fields outside the allowlist, hostPath
model sources outside the admin's directories and Ingress snippets are refused by name
(operator/pod_policy.py), unless a cluster admin opts out. Each refused case here renders
a pod that escapes its namespace's limits when the policy is off (the last cases show it
does render then): the test fails if the policy lets it through."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import NS, eventually, minimal_llmservice, schema_errors
from test_k8s_degraded import degraded, existing_children
from test_k8s_pod_template import DECODE_TEMPLATE

from pdserve.operator.kube import KubeClient
from pdserve.operator.pod_policy import PodPolicy
from pdserve.operator.render import render
from pdserve.operator.spec import SpecError
from pdserve.testing.pod_policy_probe import C0, MERGED_ESCAPES, STRICT, D, merged_escapes
from pdserve.testing.pod_policy_probe import containers as _containers
from pdserve.testing.pod_policy_probe import security_context as _security_context

# (decode podTemplate, the field the refusal names)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "hostPath volume": (
        {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
        f"{D}.volumes[0].hostPath",
    ),
    "nfs volume": (
        {"spec": {"volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]}},
        f"{D}.volumes[0].nfs",
    ),
    "inline csi volume": (
        {"spec": {"volumes": [{"name": "c", "csi": {"driver": "x"}}]}},
        f"{D}.volumes[0].csi",
    ),
    "hostPID": ({"spec": {"hostPID": True}}, f"{D}.hostPID"),
    "hostNetwork": ({"spec": {"hostNetwork": True}}, f"{D}.hostNetwork"),
    "hostIPC": ({"spec": {"hostIPC": True}}, f"{D}.hostIPC"),
    "hostUsers": ({"spec": {"hostUsers": True}}, f"{D}.hostUsers"),
    "nodeName": ({"spec": {"nodeName": "gpu-7"}}, f"{D}.nodeName"),
    "another ServiceAccount": (
        {"spec": {"serviceAccountName": "cluster-admin-sa"}},
        f"{D}.serviceAccountName",
    ),
    "the API token on a worker": (
        {"spec": {"automountServiceAccountToken": True}},
        f"{D}.automountServiceAccountToken",
    ),
    "privileged": _security_context("privileged", True),
    "added capability": (
        _containers(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
        f"{C0}.capabilities.add",
    ),
    "capabilities kept (drop: [] replaces the rendered [ALL])": (
        _containers(securityContext={"capabilities": {"drop": []}}),
        f"{C0}.capabilities.drop",
    ),
    "privilege escalation": _security_context("allowPrivilegeEscalation", True),
    "writable root filesystem": _security_context("readOnlyRootFilesystem", False),
    "root user": _security_context("runAsUser", 0),
    "runAsNonRoot off": (
        {"spec": {"securityContext": {"runAsNonRoot": False}}},
        f"{D}.securityContext.runAsNonRoot",
    ),
    "unconfined seccomp": (
        {"spec": {"securityContext": {"seccompProfile": {"type": "Unconfined"}}}},
        f"{D}.securityContext.seccompProfile.type",
    ),
    "SELinux options": _security_context("seLinuxOptions", {"type": "spc_t"}),
    "unmasked /proc": _security_context("procMount", "Unmasked"),
    "sysctls": (
        {"spec": {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}},
        f"{D}.securityContext.sysctls",
    ),
    "hostPort": (
        _containers(ports=[{"containerPort": 80, "hostPort": 80}]),
        f"{D}.containers[0].ports[0].hostPort",
    ),
    "bidirectional mount": (
        _containers(
            volumeMounts=[{"name": "tmp", "mountPath": "/x", "mountPropagation": "Bidirectional"}]
        ),
        f"{D}.containers[0].volumeMounts[0].mountPropagation",
    ),
    "privileged sidecar": (
        {
            "spec": {
                "initContainers": [
                    {"name": "s", "image": "busybox", "securityContext": {"privileged": True}}
                ]
            }
        },
        f"{D}.initContainers[0].securityContext.privileged",
    ),
    "unconfined AppArmor annotation": (
        {
            "metadata": {
                "annotations": {
                    "container.apparmor.security.beta.kubernetes.io/decode": "unconfined"
                }
            }
        },
        "spec.decode.podTemplate.metadata.annotations.container.apparmor",
    ),
}


def _refused(template: dict[str, Any], field: str) -> dict[str, Any]:
    """An LLMService with this decode podTemplate, which STRICT refuses naming ``field``."""
    obj = minimal_llmservice(decode={"podTemplate": template})
    with pytest.raises(SpecError) as info:
        render(obj, policy=STRICT)
    assert str(info.value).startswith(field), str(info.value)
    return obj


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_pod_field_is_named(case: str) -> None:
    obj = _refused(*REFUSED[case])
    # A cluster admin's opt-out renders it (so the refusal above is the policy's doing).
    render(obj, policy=PodPolicy(allow_unsafe=True))


def test_router_template_may_name_only_its_own_account() -> None:
    ok = {"spec": {"serviceAccountName": "demo-router"}}
    render(minimal_llmservice(router={"podTemplate": ok}), policy=STRICT)
    bad = minimal_llmservice(router={"podTemplate": {"spec": {"serviceAccountName": "default"}}})
    with pytest.raises(SpecError, match=r"^spec.router.podTemplate.spec.serviceAccountName"):
        render(bad, policy=STRICT)


def test_allowed_template_renders_under_the_policy() -> None:
    """The escape hatch's documented uses stay open: scheduling, Multus annotations, env,
    volumes of safe kinds, a sidecar (hardened as the rendered containers are: the merged
    pod is checked), a tightened securityContext."""
    hard = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    containers = [
        {**c, "securityContext": hard} if c["name"] == "sidecar" else c
        for c in DECODE_TEMPLATE["spec"]["containers"]
    ]
    template = {
        **DECODE_TEMPLATE,
        "spec": {
            **DECODE_TEMPLATE["spec"],
            "containers": containers,
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": {"runAsUser": 2000, "fsGroup": 2000},
            "volumes": [
                *DECODE_TEMPLATE["spec"]["volumes"],
                {"name": "cfg", "configMap": {"name": "extra"}},
                {"name": "data", "ephemeral": {}},
            ],
        },
    }
    assert render(minimal_llmservice(decode={"podTemplate": template}), policy=STRICT)


@pytest.mark.parametrize(
    "path, refused",
    [
        ("/data/models/tiny", False),
        ("/data/models/../../etc", True),
        ("/etc", True),
        ("/data/modelsX/m", True),
    ],
)
def test_model_host_path_only_under_allowed_directories(path: str, refused: bool) -> None:
    obj = minimal_llmservice(model={"source": {"hostPath": {"path": path}}})
    if not refused:
        render(obj, policy=STRICT)
        return
    with pytest.raises(SpecError, match=r"^spec.model.source.hostPath.path"):
        render(obj, policy=STRICT)
    with pytest.raises(SpecError):
        render(obj, policy=PodPolicy())  # no directory allowed by default


@pytest.mark.parametrize(
    "key, refused",
    [
        ("nginx.ingress.kubernetes.io/configuration-snippet", True),
        ("nginx.ingress.kubernetes.io/server-snippet", True),
        ("nginx.ingress.kubernetes.io/auth-url", True),
        ("nginx.ingress.kubernetes.io/proxy-body-size", False),
        ("cert-manager.io/cluster-issuer", False),
    ],
)
def test_ingress_annotations_pass_an_allowlist(key: str, refused: bool) -> None:
    ingress = {"host": "llm.example.com", "annotations": {key: "x"}}
    obj = minimal_llmservice(router={"ingress": ingress, "apiKeySecret": {"name": "keys"}})
    if not refused:
        render(obj, policy=STRICT)
        return
    with pytest.raises(SpecError, match=rf"^spec.router.ingress.annotations.{key}"):
        render(obj, policy=STRICT)


async def test_operator_refuses_unsafe_template_with_degraded(
    operator: None, client: KubeClient
) -> None:
    """The real operator (kopf on the API emulator): Degraded names the field, nothing is
    created; the schema admits the object, so only the operator can refuse it."""
    obj = minimal_llmservice("escape", decode={"podTemplate": {"spec": {"hostPID": True}}})
    assert schema_errors(obj) == []
    await client.create(obj)
    cond = await eventually(lambda: degraded(client, "escape"), what="Degraded=True")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.decode.podTemplate.spec.hostPID" in cond["message"]
    assert await existing_children(client, obj) == []
    assert await client.get("apps/v1", "Deployment", NS, "escape-decode") is None


@pytest.mark.parametrize("case", sorted(MERGED_ESCAPES))
def test_the_merged_pod_keeps_its_hardening(case: str) -> None:
    obj = _refused(*MERGED_ESCAPES[case])
    if "null" not in case:  # nulls: refused when the spec is parsed too (pod_template.py)
        render(obj, policy=PodPolicy(allow_unsafe=True))  # the opt-out renders it


def test_a_hardened_sidecar_and_the_router_pass_the_merged_check() -> None:
    hard = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    side = {"spec": {"containers": [{"name": "side", "image": "busybox", "securityContext": hard}]}}
    render(minimal_llmservice(decode={"podTemplate": side}), policy=STRICT)
    render(minimal_llmservice(router={"mode": "endpointPicker"}), policy=STRICT)
    assert merged_escapes() == 0


SHARED = {"claimName": "shared-cache"}
CACHE = {"model": {"source": {"huggingFace": {"id": "org/m", "cache": SHARED}}}}
CACHE_ESCAPES: dict[str, tuple[dict[str, Any], str]] = {
    "the cache claim read-write": (
        {"spec": {"volumes": [{"name": "c", "persistentVolumeClaim": SHARED}]}},
        f"{D}.volumes[0].persistentVolumeClaim.readOnly",
    ),
    "the model volume remounted writable": (
        _containers(volumeMounts=[{"name": "model", "mountPath": "/w", "readOnly": False}]),
        f"{D}.containers[0].volumeMounts[0]",
    ),
    "the download's env rewritten": (
        {
            "spec": {
                "initContainers": [
                    {
                        "name": "download-model",
                        "env": [{"name": "HF_ENDPOINT", "value": "http://evil"}],
                    }
                ]
            }
        },
        f"{D}.initContainers[0].name",
    ),
    "the model volume replaced": (
        {"spec": {"volumes": [{"name": "model", "emptyDir": {}}]}},
        f"{D}.volumes[0].name",
    ),
}


@pytest.mark.parametrize("case", sorted(CACHE_ESCAPES))
def test_a_template_cannot_reach_the_shared_cache(case: str) -> None:
    """Issue 44 item 4: any LLMService author could mount the shared cache claim
    read-write through podTemplate and swap weights or compiled code of another service."""
    template, field = CACHE_ESCAPES[case]
    obj = minimal_llmservice(decode={"podTemplate": template}, **CACHE)
    with pytest.raises(SpecError) as info:
        render(obj, policy=STRICT)
    assert str(info.value).startswith(field), str(info.value)
    ro = {
        "spec": {
            "volumes": [
                {"name": "c", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}}
            ]
        }
    }
    render(minimal_llmservice(decode={"podTemplate": ro}, **CACHE), policy=STRICT)
