"""``pdserve operator``: run the LLMService operator (kopf) in this process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random

import kopf

from pdserve import env
from pdserve.operator.autoscaler import AutoscaleSettings
from pdserve.operator.handlers import OperatorConfig, register
from pdserve.operator.pod_policy import PodPolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)"
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch the whole cluster"
    )
    parser.add_argument("--status-interval", type=float, default=60.0,
                        help="seconds between resyncs from the watch cache (a safety net; "
                        "status and drift repair follow watch events)")  # fmt: skip
    parser.add_argument("--retry-delay", type=float, default=30.0, help="retry delay when a "
                        "referenced Secret/PVC is missing")  # fmt: skip
    parser.add_argument("--autoscale-tick", type=float, default=5.0,
                        help="autoscaler timer seconds (each LLMService plans every "
                        "spec.autoscaling.intervalSeconds)")  # fmt: skip
    parser.add_argument("--router-metrics-url", default="",
                        help="router /metrics URL template with {service} {namespace} {port} "
                        "(default: the router's admin Service in-cluster)")  # fmt: skip
    parser.add_argument("--metrics-url-allow", action="append", default=[], metavar="CIDR",
                        type=_cidr,
                        help="a network spec.autoscaling.metricsUrl may resolve into "
                        "(repeatable; default: any but metadata, link-local and "
                        "loopback addresses)")  # fmt: skip
    parser.add_argument("--health-port", type=int, default=8080, help="liveness endpoint port")
    parser.add_argument("--peering", default="", help="kopf peering name (default: standalone)")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; default: random, so that replicas never tie "
                        "(kopf pauses every replica of a tied top priority)")  # fmt: skip
    parser.add_argument("--default-image", default=env.get(env.DEFAULT_IMAGE),
                        help="image for LLMServices without spec.image (resolved at render "
                        "time; the chart passes its own image)")  # fmt: skip
    parser.add_argument(
        "--allow-unsafe-pod-fields",
        action="store_true",
        help="let LLMServices set any podTemplate field (hostPath, "
        "hostNetwork, privileged, other ServiceAccounts, ...): only where "
        "every LLMService author is a cluster admin (operator/pod_policy.py)",
    )
    parser.add_argument(
        "--allow-model-host-path",
        action="append",
        default=[],
        metavar="DIR",
        help="a host directory (and below) that "
        "spec.model.source.hostPath may name (repeatable; default: none)",
    )
    parser.add_argument("--verbose", "-v", action="store_true")


def _cidr(value: str) -> str:
    import ipaddress

    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--metrics-url-allow {value!r}: {exc}") from None
    return value


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, config)
    return registry


def run(args: argparse.Namespace) -> int:
    if not args.namespace and not args.all_namespaces:
        print("pdserve operator: pass --namespace NS (repeatable) or --all-namespaces")
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    config = OperatorConfig(
        status_interval=args.status_interval,
        retry_delay=args.retry_delay,
        autoscale_tick=args.autoscale_tick,
        default_image=args.default_image,
        autoscale=AutoscaleSettings(
            router_metrics_url=args.router_metrics_url,
            metrics_url_allow=tuple(args.metrics_url_allow),
        ),
        pod_policy=PodPolicy(args.allow_unsafe_pod_fields, tuple(args.allow_model_host_path)),
    )
    asyncio.run(
        kopf.operator(
            registry=build_registry(config),
            clusterwide=args.all_namespaces,
            namespaces=list(args.namespace),
            standalone=not args.peering,
            peering_name=args.peering or None,
            priority=args.priority if args.priority is not None else random.randint(1, 2**30),
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
        )
    )
    return 0
