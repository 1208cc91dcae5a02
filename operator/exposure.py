"""Where an LLMService may be reached from: the platform team's limits on its Service,
Ingress and HTTPRoute (docs/security.md, "LLMService authors").

Without them a team that may create LLMServices in its own namespace could open the
service on every node (``NodePort``), buy a cloud load balancer, claim any host name on
the shared Ingress controller, or attach its route to another namespace's Gateway. The
operator's flags name what is allowed: Service types (``--allow-service-type``, default
``ClusterIP`` only), Ingress classes (``--allow-ingress-class``) and host suffixes
(``--allow-host-suffix``, for Ingress hosts and HTTPRoute hostnames; both: any when
unset), and the namespaces whose Gateways a route may name (``--allow-gateway-namespace``;
default: the service's own). A service reached from outside its namespace's pods (a
non-ClusterIP Service, an Ingress, an HTTPRoute) must set ``apiKeySecret``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.operator.spec import LLMServiceSpec


@dataclass(frozen=True)
class ExposurePolicy:
    service_types: tuple[str, ...] = ("ClusterIP",)
    ingress_classes: tuple[str, ...] = ()  # empty: any class
    host_suffixes: tuple[str, ...] = ()  # empty: any host
    gateway_namespaces: tuple[str, ...] = ()  # beside the service's own


def _host_allowed(host: str, suffixes: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    for suffix in suffixes:
        s = suffix.lower().strip(".")
        if host == s or host.endswith("." + s):
            return True
    return not suffixes


def _allowed(values: tuple[str, ...]) -> str:
    return ", ".join(values) or "none"


def exposure_violations(svc: LLMServiceSpec, policy: ExposurePolicy) -> Iterator[tuple[str, str]]:
    """``(field, why)`` for every way ``svc`` is exposed beyond ``policy``."""
    r = svc.router
    if r.service_type not in policy.service_types:
        yield (
            "spec.router.serviceType",
            f"{r.service_type!r} is not a Service type the operator allows "
            f"({_allowed(policy.service_types)}; --allow-service-type)",
        )
    if r.ingress is not None:
        classes = policy.ingress_classes
        if classes and r.ingress.class_name not in classes:
            yield (
                "spec.router.ingress.className",
                f"{r.ingress.class_name or '(the default class)'!r} is not an Ingress class the "
                f"operator allows ({_allowed(classes)}; --allow-ingress-class)",
            )
        if not _host_allowed(r.ingress.host, policy.host_suffixes):
            yield ("spec.router.ingress.host", _host_why(r.ingress.host, policy))
    for i, host in enumerate(r.http_route_hostnames):
        if not _host_allowed(host, policy.host_suffixes):
            yield (f"spec.router.httpRoute.hostnames[{i}]", _host_why(host, policy))
    allowed_ns = (svc.namespace, *policy.gateway_namespaces)
    for i, ref in enumerate(r.http_route_parents):
        ns = str(ref.get("namespace") or svc.namespace)
        if ns not in allowed_ns:
            yield (
                f"spec.router.httpRoute.parentRefs[{i}].namespace",
                f"{ns!r}: a route may name Gateways only in its own namespace or one the "
                f"operator allows ({_allowed(policy.gateway_namespaces)}; "
                "--allow-gateway-namespace)",
            )
    guarded = r.gateway_token_secret or r.ext_proc_tls_secret
    to_gateway = r.http_route_parents or svc.network_policy.gateway_namespaces
    if r.mode == "endpointPicker" and to_gateway and not guarded:
        yield (
            "spec.router.extProcTLSSecret",
            "or spec.router.gatewayTokenSecret is required when the endpoint picker is "
            "exposed to a gateway (an HTTPRoute or networkPolicy.gatewayNamespaces): "
            "without either, any pod that reaches its ext_proc port picks, and its "
            "forged 'served' metadata takes decode workers out",
        )
    exposed = r.service_type != "ClusterIP" or r.ingress is not None or r.http_route_parents
    if exposed and not r.api_key_secret:
        yield (
            "spec.router.apiKeySecret",
            "is required when the service is exposed (a LoadBalancer or NodePort Service, an "
            "Ingress or an HTTPRoute): without it anyone who reaches it is served",
        )


def _host_why(host: str, policy: ExposurePolicy) -> str:
    return (
        f"{host!r} does not end in a host suffix the operator allows "
        f"({_allowed(policy.host_suffixes)}; --allow-host-suffix)"
    )
