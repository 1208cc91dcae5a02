"""``pdserve operator``'s flags: the fields of :class:`OperatorArgs` (pdserve/config_cli.py).
Importing this module loads no kopf."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config_cli import flag_group


def cidr(value: str) -> str:
    """``--metrics-url-allow``'s check at parse time: a network (argparse names the flag)."""
    import ipaddress

    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--metrics-url-allow {value!r}: {exc}") from None
    return value


flag_scope = flag_group("what it watches")
flag_run = flag_group("running")
flag_policy = flag_group("pod policy (docs/security.md)")


def allowed(what: str, metavar: str, default: str) -> Any:
    """A pod-policy allowlist: a repeatable flag of ``what`` LLMServices may name, its help
    ending in what an empty list allows."""
    help = f"{what} (repeatable; default: {default})"
    return flag_policy((), help, metavar=metavar, many="append")


@dataclass(frozen=True)
class OperatorArgs:
    """Where the operator watches, how it runs, and what LLMServices may ask of pods."""

    namespace: tuple[str, ...] = flag_scope(
        (),
        "watch this namespace (repeatable)",
        short=True,
        many="append",
        exclusive="scope",
        aliases=("-n",),
    )
    all_namespaces: bool = flag_scope(
        False,
        "watch the whole cluster",
        short=True,
        exclusive="scope",
        aliases=("-A",),
    )
    status_interval: float = flag_run(
        60.0,
        "seconds between resyncs from the watch cache (a "
        "safety net; status and drift repair follow watch events)",
    )
    retry_delay: float = flag_run(30.0, "retry delay when a referenced Secret/PVC is missing")
    autoscale_tick: float = flag_run(
        5.0,
        "autoscaler timer seconds (each LLMService plans every spec.autoscaling.intervalSeconds)",
    )
    router_metrics_url: str = flag_run(
        "",
        "router /metrics URL template with {service} "
        "{namespace} {port} (default: the router's admin Service "
        "in-cluster)",
    )
    metrics_url_allow: tuple[str, ...] = flag_run(
        (),
        "a network spec.autoscaling.metricsUrl may resolve into (repeatable; default: any but "
        "metadata, link-local and loopback addresses)",
        metavar="CIDR",
        parse=cidr,
        many="append",
    )
    health_port: int = flag_run(8080, "liveness endpoint port", short=True)
    peering: str = flag_run("", "kopf peering name (default: standalone)", short=True)
    priority: int | None = flag_run(
        None,
        "peering priority; default: random, so that replicas "
        "never tie (kopf pauses every replica of a tied top priority)",
    )
    default_image: str = flag_run(
        "",
        "image for LLMServices without spec.image (resolved at "
        "render time; the chart passes its own image)",
        short=True,
        env=env.DEFAULT_IMAGE,
    )
    verbose: bool = flag_run(False, "debug logging", short=True, aliases=("-v",))
    allow_unsafe_pod_fields: bool = flag_policy(
        False,
        "let LLMServices set any podTemplate field "
        "(hostPath, hostNetwork, privileged, other "
        "ServiceAccounts, ...): only where every LLMService "
        "author is a cluster admin (operator/pod_policy.py)",
    )
    allow_model_host_path: tuple[str, ...] = allowed(
        "a host directory (and below) that spec.model.source.hostPath may name", "DIR", "none"
    )
    allow_service_type: tuple[str, ...] = flag_policy(
        (),
        "a router Service type LLMServices may ask for besides ClusterIP (LoadBalancer, "
        "NodePort; repeatable; operator/exposure.py)",
        metavar="TYPE",
        many="append",
        choices=("LoadBalancer", "NodePort"),
    )
    allow_ingress_class: tuple[str, ...] = allowed(
        "an Ingress class spec.router.ingress.className may name", "CLASS", "any"
    )
    allow_host_suffix: tuple[str, ...] = allowed(
        "a DNS suffix Ingress hosts and HTTPRoute hostnames must end in", "SUFFIX", "any host"
    )
    allow_gateway_namespace: tuple[str, ...] = allowed(
        "a namespace whose Gateways an HTTPRoute's parentRefs may name",
        "NS",
        "the service's own only",
    )


FLAGS = (OperatorArgs,)
