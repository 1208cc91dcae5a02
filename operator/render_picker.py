"""``spec.router.mode: endpointPicker``: the router as a Gateway API Inference Extension
endpoint picker behind an ``InferencePool``. A pure function over the rendered children.

    Gateway ──HTTPRoute──▶ InferencePool (decode pods, targetPort: the front)
        │  ext_proc (gRPC)        │ endpointPickerRef
        ▼                         ▼
    <name>-router Service:9002 ── the router Deployment, run as the picker
        picks the decode pod (x-gateway-destination-endpoint) and the prefill worker
        (a signed x-prefiller-host-port)
    decode pod: front :8084 (pdserve router --prefill-from-header over the pod's own
        decode worker) ──▶ prefill on the named worker, KV pulled as usual

What changes against the built-in router mode: the router Deployment's command
(``--mode endpoint-picker``), its ports and probes (gRPC on ``grpc``; ``/metrics`` stays
on ``admin``), the router
Service (the gRPC port, ``appProtocol: kubernetes.io/h2c``), a ``front`` container in
each decode pod, the HTTPRoute's backend (the InferencePool), the NetworkPolicy (the
front's port open to the gateway) and the InferencePool itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pdserve.operator import naming as n
from pdserve.operator import render_pods as p
from pdserve.operator.spec import LLMServiceSpec

Manifest = dict[str, Any]
MODE = "endpointPicker"
INFERENCE_API = "inference.networking.k8s.io/v1"
GRPC_PORT = 9002  # the picker's ext_proc + gRPC health (the extension's usual port)
FRONT_PORT = 8084  # a decode pod's front: the InferencePool's targetPort
# The router's tenant-facing flags a decode pod's front repeats (the picker enforces the
# same limits for the whole service before the gateway routes; docs/security.md).
FRONT_FLAGS = (
    "--api-key-file",
    "--max-queue",
    "--lora",
    "--rate-limit-rpm",
    "--rate-limit-tpm",
    "--max-concurrency-per-key",
    "--max-waiting",
    "--max-body-bytes",
    "--max-prompt-chars",
    "--max-schema-bytes",
    "--body-timeout",
)
_TOKEN_DIR = "/etc/pdserve/gateway-token"
_TLS_DIR = "/etc/pdserve/ext-proc-tls"  # tls.crt, tls.key, ca.crt (cert-manager's keys)
_FRONT_RESOURCES = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def apply(spec: LLMServiceSpec, children: list[Manifest]) -> list[Manifest]:
    """The children of picker mode (the list unchanged in router mode)."""
    if spec.router.mode != MODE:
        return children
    edits: dict[tuple[str, str], Callable[[LLMServiceSpec, Manifest], Manifest]] = {
        ("Deployment", n.deployment_name(spec.name, "router")): _picker_deployment,
        ("Deployment", n.deployment_name(spec.name, "decode")): _decode_with_front,
        ("Service", n.router_service_name(spec.name)): _picker_service,
        ("HTTPRoute", spec.name): _route_to_pool,
        ("NetworkPolicy", n.network_policy_name(spec.name)): _front_open,
    }
    out = []
    for child in children:
        edit = edits.get((child["kind"], child["metadata"]["name"]))
        out.append(edit(spec, copy.deepcopy(child)) if edit else child)
    return [*out, inference_pool(spec)]


def inference_pool(spec: LLMServiceSpec) -> Manifest:
    meta = {"name": spec.name, "namespace": spec.namespace, "labels": n.labels(spec.name)}
    body = {
        "selector": {"matchLabels": n.selector(spec.name, "decode")},
        "targetPorts": [{"number": FRONT_PORT}],
        "endpointPickerRef": {
            "name": n.router_service_name(spec.name),
            "kind": "Service",
            "port": {"number": GRPC_PORT},
            "failureMode": "FailClose",  # no pick, no request: never an unscored pod
        },
    }
    return {"apiVersion": INFERENCE_API, "kind": "InferencePool", "metadata": meta, "spec": body}


def _grpc_probe(service: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": GRPC_PORT, "service": service},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _picker_deployment(spec: LLMServiceSpec, dep: Manifest) -> Manifest:
    c = dep["spec"]["template"]["spec"]["containers"][0]
    c["command"] = [
        *c["command"],
        "--mode",
        "endpoint-picker",
        "--grpc-port",
        str(GRPC_PORT),
        "--target-port",
        str(FRONT_PORT),
    ]
    if spec.router.gateway_token_secret:  # only the gateway's streams are taken
        c["command"] += ["--gateway-token-file", f"{_TOKEN_DIR}/{spec.router.gateway_token_key}"]
        secret = {"secretName": spec.router.gateway_token_secret, "defaultMode": 0o440}
        dep["spec"]["template"]["spec"]["volumes"].append(
            {"name": "gateway-token", "secret": secret}
        )
        c["volumeMounts"].append(
            {"name": "gateway-token", "mountPath": _TOKEN_DIR, "readOnly": True}
        )
    admin = {"name": "admin", "containerPort": n.ADMIN_PORT, "protocol": "TCP"}  # /metrics
    c["ports"] = [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}, admin]
    probe = _grpc_probe
    if spec.router.ext_proc_tls_secret:  # mutual TLS: only the gateway's certificate
        c["command"] += [
            "--ext-proc-tls-cert",
            f"{_TLS_DIR}/tls.crt",
            "--ext-proc-tls-key",
            f"{_TLS_DIR}/tls.key",
            "--ext-proc-client-ca",
            f"{_TLS_DIR}/ca.crt",
        ]
        secret = {"secretName": spec.router.ext_proc_tls_secret, "defaultMode": 0o440}
        pod = dep["spec"]["template"]["spec"]
        pod["volumes"].append({"name": "ext-proc-tls", "secret": secret})
        c["volumeMounts"].append({"name": "ext-proc-tls", "mountPath": _TLS_DIR, "readOnly": True})
        probe = _http_probe  # the kubelet's gRPC probe speaks no TLS
    c["startupProbe"] = probe("liveness", 10, 180)
    c["readinessProbe"] = probe("readiness", 5, 3)
    c["livenessProbe"] = probe("liveness", 10, 6)
    return dep


def _http_probe(service: str, period: int, failures: int) -> dict[str, Any]:
    """The picker's health on its admin port (router/picker/service.py): ``/livez`` for
    liveness, ``/health`` for readiness."""
    path = "/livez" if service == "liveness" else "/health"
    return {
        "httpGet": {"path": path, "port": "admin"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _picker_service(spec: LLMServiceSpec, svc: Manifest) -> Manifest:
    svc["spec"]["type"] = "ClusterIP"  # only the gateway's ext_proc client calls it
    svc["spec"]["ports"] = [
        {
            "name": "grpc",
            "port": GRPC_PORT,
            "targetPort": "grpc",
            "protocol": "TCP",
            "appProtocol": "kubernetes.io/h2c",
        }
    ]
    return svc


def front_command(spec: LLMServiceSpec) -> list[str]:
    """The decode pod's front: the router over this pod's decode worker alone, taking the
    prefill worker from the picker's signed header; the router's keys and limits apply."""
    router = p.router_command(spec)
    keep = []
    for i, arg in enumerate(router):  # the tenant-facing flags carry over
        if arg in FRONT_FLAGS and i + 1 < len(router):
            keep += [arg, router[i + 1]]
    cmd = [
        "pdserve",
        "router",
        "--model",
        p.model_dir(spec),
        "--served-model-name",
        spec.model.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(FRONT_PORT),
        "--decode",
        f"http://127.0.0.1:{n.HTTP_PORT}",
        "--prefill-from-header",
    ]
    return cmd + keep


def _decode_with_front(spec: LLMServiceSpec, dep: Manifest) -> Manifest:
    pod = dep["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    probe = {"periodSeconds": 5, "timeoutSeconds": 5}
    front = {
        "name": "front",
        "image": worker["image"],
        "imagePullPolicy": worker["imagePullPolicy"],
        "command": front_command(spec),
        "ports": [{"name": "front", "containerPort": FRONT_PORT, "protocol": "TCP"}],
        "env": copy.deepcopy(worker["env"]),
        "envFrom": copy.deepcopy(worker["envFrom"]),
        "resources": copy.deepcopy(_FRONT_RESOURCES),
        "volumeMounts": [_read_only(m) for m in worker["volumeMounts"] if _read_mount(m)],
        "securityContext": p.container_security(spec, False),
        "lifecycle": copy.deepcopy(worker["lifecycle"]),
        "startupProbe": {
            "httpGet": {"path": "/livez", "port": "front"},
            **probe,
            "failureThreshold": 360,
        },
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "front"},
            **probe,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/livez", "port": "front"},
            **probe,
            "failureThreshold": 6,
        },
    }
    if spec.router.api_key_secret:
        secret = {"secretName": spec.router.api_key_secret, "defaultMode": 0o440}
        pod["volumes"].append({"name": "api-key", "secret": secret})
        front["volumeMounts"].append(
            {"name": "api-key", "mountPath": "/etc/pdserve/api-key", "readOnly": True}
        )
    pod["containers"].append(front)
    return dep


def _read_mount(m: dict[str, Any]) -> bool:
    """The model (tokenizer), /tmp, the LoRA adapters (the front serves adapter names
    and hashes their files as the router does) and the workers' compiled-code folder,
    where their model seal is (engine/model_seal.py: the front's tokenizer is loaded as
    sealed), which the front only reads."""
    return m["name"] in ("tmp", "model") or m["name"].startswith("adapters-")


def _read_only(m: dict[str, Any]) -> dict[str, Any]:
    """A copy of the worker's mount, read-only where it is the shared cache's."""
    out = copy.deepcopy(m)
    if "subPath" in out:
        out["readOnly"] = True
    return out


def _route_to_pool(spec: LLMServiceSpec, route: Manifest) -> Manifest:
    pool = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": spec.name}
    for rule in route["spec"]["rules"]:
        rule["backendRefs"] = [dict(pool)]
    return route


def _front_open(spec: LLMServiceSpec, policy: Manifest) -> Manifest:
    """The gateway's pods are in a namespace of their own: the front's port is open to
    every source (it checks API keys as the router does); the workers' ports stay closed."""
    policy["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": FRONT_PORT}]})
    return policy
