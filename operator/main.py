"""``pdserve operator``: run the LLMService operator (kopf) in this process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random

import kopf

from pdserve import env
from pdserve.config_cli import add_flags
from pdserve.operator.args import FLAGS as FLAGS
from pdserve.operator.autoscaler import AutoscaleSettings
from pdserve.operator.exposure import ExposurePolicy
from pdserve.operator.handlers import OperatorConfig, register
from pdserve.operator.pod_policy import PodPolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's flags (operator/args.py) on ``parser``."""
    add_flags(parser, FLAGS)


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    register(registry, config)
    return registry


def pod_policy(args: argparse.Namespace) -> PodPolicy:
    """What LLMServices may ask of pods and where they may be exposed (the POLICY flags)."""
    return PodPolicy(
        args.allow_unsafe_pod_fields,
        tuple(args.allow_model_host_path),
        ExposurePolicy(
            ("ClusterIP", *args.allow_service_type),
            tuple(args.allow_ingress_class),
            tuple(args.allow_host_suffix),
            tuple(args.allow_gateway_namespace),
        ),
    )


def run(args: argparse.Namespace) -> int:
    if not args.namespace and not args.all_namespaces:
        print("pdserve operator: pass --namespace NS (repeatable) or --all-namespaces")
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    config = OperatorConfig(
        status_interval=args.status_interval,
        retry_delay=args.retry_delay,
        autoscale_tick=args.autoscale_tick,
        default_image=args.default_image or env.get(env.DEFAULT_IMAGE),
        autoscale=AutoscaleSettings(
            router_metrics_url=args.router_metrics_url,
            metrics_url_allow=tuple(args.metrics_url_allow),
        ),
        pod_policy=pod_policy(args),
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
