"""The router pods' NetworkPolicy (issue 44): the admin port is not for every pod.

The router's ``--admin-port`` (8083) serves ``/metrics`` and ``/workers`` without a key
(the operator's autoscaler and Prometheus scrape it). Without a policy any pod of any
namespace reaches it. This policy selects the router pods and opens:

- the public port (the API; in endpointPicker mode the picker's gRPC port) to every
  source: tenants come through the Ingress, a LoadBalancer or the gateway, whose pods
  live in namespaces of their own; in endpointPicker mode with
  ``spec.networkPolicy.gatewayNamespaces``, the gRPC port only to those namespaces;
- the admin port only to the operator's pods (namespace ``PDSERVE_OPERATOR_NAMESPACE``,
  set by the chart from the downward API; the service's own namespace when unset), to
  the service's own router pods (their signed per-key budget calls, router/peer_budgets.py)
  and to ``spec.networkPolicy.metricsNamespaces``.

Routes that change state (LoRA load/unload) need the admin key on every port anyway
(router/runtime.py): this policy narrows who can read, not who can write.
"""

from __future__ import annotations

from typing import Any

from pdserve import env
from pdserve.operator import naming as n
from pdserve.operator.render_picker import GRPC_PORT, MODE
from pdserve.operator.spec import LLMServiceSpec

Manifest = dict[str, Any]
OPERATOR_COMPONENT = {
    "app.kubernetes.io/name": "pdserve",
    "app.kubernetes.io/component": "operator",
}


def router_policy_name(name: str) -> str:
    return f"{name}-router"


def operator_namespace(spec: LLMServiceSpec) -> str:
    return env.get(env.OPERATOR_NAMESPACE) or spec.namespace


def _in_namespaces(names: list[str]) -> dict[str, Any]:
    expr = {"key": "kubernetes.io/metadata.name", "operator": "In", "values": names}
    return {"namespaceSelector": {"matchExpressions": [expr]}}


def admin_sources(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    """Who may reach the admin port: the operator's pods, the metrics namespaces."""
    operator = {
        **_in_namespaces([operator_namespace(spec)]),
        "podSelector": {"matchLabels": dict(OPERATOR_COMPONENT)},
    }
    # the service's other router replicas: per-key budget calls (router/peer_budgets.py)
    peers = {"podSelector": {"matchLabels": n.selector(spec.name, "router")}}
    out: list[dict[str, Any]] = [operator, peers]
    if spec.network_policy.metrics_namespaces:
        out.append(_in_namespaces(list(spec.network_policy.metrics_namespaces)))
    return out


def router_network_policy(spec: LLMServiceSpec) -> list[Manifest]:
    """The router pods' ingress rules (none when ``spec.networkPolicy.enabled`` is off)."""
    if not spec.network_policy.enabled:
        return []
    public_port = GRPC_PORT if spec.router.mode == MODE else n.HTTP_PORT
    name = router_policy_name(spec.name)
    meta = {"name": name, "namespace": spec.namespace, "labels": n.labels(spec.name, "router")}
    public: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": public_port}]}
    gateways = list(spec.network_policy.gateway_namespaces)
    if spec.router.mode == MODE and gateways:  # the picker: the gateway's pods alone
        public["from"] = [_in_namespaces(gateways)]
    rules = [
        public,
        {"from": admin_sources(spec), "ports": [{"protocol": "TCP", "port": n.ADMIN_PORT}]},
    ]
    body = {
        "podSelector": {"matchLabels": n.selector(spec.name, "router")},
        "policyTypes": ["Ingress"],
        "ingress": rules,
    }
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta,
            "spec": body,
        }
    ]
