"""Rendering: one LLMService → the list of its child manifests. A pure function.

The same function feeds the operator (which adopts and applies the children),
``pdserve render -f llmservice.yaml`` and the tests. No owner references here:
the operator adds them (``kopf.adopt``) because only it knows the object's uid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pdserve import env
from pdserve.operator import kv_tiers
from pdserve.operator import naming as n
from pdserve.operator.pod_policy import PodPolicy, check_service
from pdserve.operator.render_deployments import pool_deployment, router_deployment
from pdserve.operator.render_netpol import router_network_policy, router_policy_name
from pdserve.operator.render_picker import INFERENCE_API
from pdserve.operator.render_picker import apply as picker_mode
from pdserve.operator.spec import LLMServiceSpec
from pdserve.operator.spec_parse import parse_llmservice

Manifest = dict[str, Any]
HTTP_ROUTE_API = "gateway.networking.k8s.io/v1"
DEFAULT_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"  # the operator passes its own (--default-image)


def _meta(spec: LLMServiceSpec, name: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": n.labels(spec.name, role)}


def config_data(spec: LLMServiceSpec) -> dict[str, str]:
    """Environment for every container (envFrom) plus the settings as JSON for humans/planner."""
    kv, slo = spec.kv_transfer, spec.slo
    data = {env.SERVICE: spec.name, env.KV_TRANSPORT: kv.transport}
    if kv.ucx_tls:
        data["UCX_TLS"] = kv.ucx_tls
    if kv.ucx_net_devices:
        data["UCX_NET_DEVICES"] = kv.ucx_net_devices
    if kv.transport == "nixl":
        data["UCX_TCP_PORT_RANGE"] = f"{kv.ucx_tcp_port_start}-{kv.ucx_tcp_port_end}"
    settings = {
        "model": spec.model.served_name,
        "dtype": spec.model.dtype,
        "blockSize": spec.model.block_size,
        "maxModelLen": spec.model.max_model_len,
        "kvTransport": kv.transport,
        "slo": {
            "ttftMs": slo.ttft_ms,
            "tpotMs": slo.tpot_ms,
            "targetAttainment": slo.target_attainment,
        },
    }
    data["settings.json"] = json.dumps(settings, sort_keys=True)
    return data


def config_map(spec: LLMServiceSpec) -> Manifest:
    meta = _meta(spec, n.config_map_name(spec.name))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": config_data(spec)}


def router_rbac(spec: LLMServiceSpec) -> list[Manifest]:
    """The router's discovery identity: it watches the EndpointSlices of its pool Services
    (``router/discovery/k8s.py``), read-only, in its namespace; nothing else."""
    name = n.router_account_name(spec.name)
    read = ["get", "list", "watch"]
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(spec, name, "router"),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(spec, name, "router"),
            "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(spec, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
        },
    ]


def services(spec: LLMServiceSpec) -> list[Manifest]:
    http = {"name": "http", "port": n.ROUTER_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}
    router = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, n.router_service_name(spec.name), "router"),
        "spec": {
            "type": spec.router.service_type,
            "selector": n.selector(spec.name, "router"),
            "ports": [http],
        },
    }
    out = [router, _router_admin_service(spec)]
    for role in n.POOL_ROLES:
        ports = [
            {"name": "http", "port": n.HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            {
                "name": "side-channel",
                "port": n.SIDE_CHANNEL_PORT,
                "targetPort": "side-channel",
                "protocol": "TCP",
            },
        ]
        if role == "prefill":
            ports.append(
                {
                    "name": "kv-events",
                    "port": n.KV_EVENTS_PORT,
                    "targetPort": "kv-events",
                    "protocol": "TCP",
                }
            )
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(spec, n.pool_service_name(spec.name, role), role),
                "spec": {
                    "clusterIP": "None",
                    "selector": n.selector(spec.name, role),
                    "ports": ports,
                },
            }
        )
    return out


def _router_admin_service(spec: LLMServiceSpec) -> Manifest:
    """The router's admin port (/metrics, /workers without a key), always ClusterIP: the
    router Service may be a LoadBalancer, and the Ingress/HTTPRoute point at that one only.
    The operator's autoscaler and Prometheus (ServiceMonitor port ``admin``) scrape here."""
    admin = {"name": "admin", "port": n.ADMIN_PORT, "targetPort": "admin", "protocol": "TCP"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, n.router_admin_service_name(spec.name), "router"),
        "spec": {
            "type": "ClusterIP",
            "selector": n.selector(spec.name, "router"),
            "ports": [admin],
        },
    }


def ingress(spec: LLMServiceSpec) -> list[Manifest]:
    ing = spec.router.ingress
    if ing is None:
        return []
    backend = {"service": {"name": n.router_service_name(spec.name), "port": {"name": "http"}}}
    body: dict[str, Any] = {
        "rules": [
            {
                "host": ing.host,
                # Only the OpenAI API: the router's /metrics, /workers, probes and the
                # LoRA admin routes stay inside.
                "http": {
                    "paths": [
                        {"path": path, "pathType": "Prefix", "backend": backend}
                        for path in n.PUBLIC_API_PATHS
                    ]
                },
            }
        ]
    }
    if ing.class_name:
        body["ingressClassName"] = ing.class_name
    if ing.tls_secret_name:
        body["tls"] = [{"hosts": [ing.host], "secretName": ing.tls_secret_name}]
    meta = _meta(spec, spec.name, "router")
    if ing.annotations:
        meta["annotations"] = dict(ing.annotations)
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": body}
    ]


def http_route(spec: LLMServiceSpec) -> list[Manifest]:
    """An optional Gateway API HTTPRoute to the router: only the OpenAI API's public paths."""
    r = spec.router
    if not r.http_route_parents:
        return []
    backend = {"name": n.router_service_name(spec.name), "port": n.ROUTER_SERVICE_PORT}
    body: dict[str, Any] = {
        "parentRefs": [dict(p) for p in r.http_route_parents],
        "rules": [
            {
                "matches": [
                    {"path": {"type": "PathPrefix", "value": path}} for path in n.PUBLIC_API_PATHS
                ],
                "backendRefs": [backend],
            }
        ],
    }
    if r.http_route_hostnames:
        body["hostnames"] = list(r.http_route_hostnames)
    meta = _meta(spec, spec.name, "router")
    return [{"apiVersion": HTTP_ROUTE_API, "kind": "HTTPRoute", "metadata": meta, "spec": body}]


def disruption_budgets(spec: LLMServiceSpec) -> list[Manifest]:
    """One PDB per Deployment with more than one replica: for a single pod a budget either
    blocks every node drain (minAvailable 1) or protects nothing (maxUnavailable 1)."""
    counts = {
        "router": spec.router.replicas,
        "prefill": spec.prefill.replicas,
        "decode": spec.decode.replicas,
    }
    if spec.autoscaling.enabled:  # the count moves; at one pod maxUnavailable 1 is harmless
        counts.update(prefill=spec.prefill.max_replicas, decode=spec.decode.max_replicas)
    return [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(spec, n.deployment_name(spec.name, role), role),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": n.selector(spec.name, role)}},
        }
        for role in n.ROLES
        if counts[role] > 1
    ]


def network_policy(spec: LLMServiceSpec) -> list[Manifest]:
    """Worker ports are reachable only from the router and peer workers of this service."""
    if not spec.network_policy.enabled:
        return []
    ports: list[dict[str, Any]] = [
        {"protocol": "TCP", "port": p} for p in (n.HTTP_PORT, n.KV_EVENTS_PORT, n.SIDE_CHANNEL_PORT)
    ]
    kv = spec.kv_transfer
    if kv.transport == "nixl":  # exactly the pinned UCX_TCP_PORT_RANGE, nothing ephemeral
        ports.append(
            {"protocol": "TCP", "port": kv.ucx_tcp_port_start, "endPort": kv.ucx_tcp_port_end}
        )
    peers = {"podSelector": {"matchLabels": {n.LABEL_SERVICE: spec.name}}}
    rules: list[dict[str, Any]] = [{"from": [peers], "ports": ports}]
    if spec.network_policy.metrics_namespaces:
        ns = {
            "key": "kubernetes.io/metadata.name",
            "operator": "In",
            "values": list(spec.network_policy.metrics_namespaces),
        }
        rules.append(
            {
                "from": [{"namespaceSelector": {"matchExpressions": [ns]}}],
                "ports": [{"protocol": "TCP", "port": n.HTTP_PORT}],
            }
        )
    workers = {
        "matchLabels": {n.LABEL_SERVICE: spec.name},
        "matchExpressions": [{"key": n.LABEL_ROLE, "operator": "In", "values": list(n.POOL_ROLES)}],
    }
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(spec, n.network_policy_name(spec.name)),
            "spec": {"podSelector": workers, "policyTypes": ["Ingress"], "ingress": rules},
        }
    ]


def config_hash(data: Mapping[str, str]) -> str:
    """Hash of what pods read from the ConfigMap (its environment variables), so that a
    change there rolls the pods. ``settings.json`` is for people and the planner only:
    an SLO edit must not roll every GPU pod."""
    env = {k: v for k, v in data.items() if k.replace("_", "").isalnum()}
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def render_spec(spec: LLMServiceSpec, default_image: str = "") -> list[Manifest]:
    """All children of one LLMService, in creation order (config and RBAC before pods).

    An unset ``spec.image`` becomes ``default_image`` here, at render time, never in the
    stored object: upgrading the operator (its chart) rolls every LLMService that does
    not pin an image onto the new one.
    """
    if not spec.image:
        spec = dataclasses.replace(spec, image=default_image or DEFAULT_IMAGE)
    cm = config_map(spec)
    digest = config_hash(cm["data"])
    children = [
        *router_rbac(spec),
        cm,
        *services(spec),
        *ingress(spec),
        *http_route(spec),
        *disruption_budgets(spec),
        *network_policy(spec),
        *router_network_policy(spec),
        pool_deployment(spec, spec.prefill, digest),
        pool_deployment(spec, spec.decode, digest),
        router_deployment(spec, digest),
        *kv_tiers.store_children(spec),
    ]
    return picker_mode(spec, children)  # router.mode endpointPicker: InferencePool and picker


def render(
    obj: Mapping[str, Any],
    default_namespace: str = "default",
    default_image: str = "",
    policy: PodPolicy | None = None,
) -> list[Manifest]:
    """Render an LLMService object (as read from YAML or the API); raises SpecError, also
    for a field ``policy`` refuses (None: no pod policy, as for a cluster admin)."""
    svc = parse_llmservice(obj, default_namespace)
    if policy is not None:
        check_service(svc, policy)
    return render_spec(svc, default_image)


def optional_children(name: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of children that only some specs have: pruned when gone."""
    return [
        ("networking.k8s.io/v1", "Ingress", name),
        (HTTP_ROUTE_API, "HTTPRoute", name),
        (INFERENCE_API, "InferencePool", name),
        ("networking.k8s.io/v1", "NetworkPolicy", n.network_policy_name(name)),
        ("networking.k8s.io/v1", "NetworkPolicy", router_policy_name(name)),
        *(("policy/v1", "PodDisruptionBudget", n.deployment_name(name, r)) for r in n.ROLES),
        *kv_tiers.optional_children(name),
    ]
