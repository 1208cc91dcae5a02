"""The router's configuration and worker source from its parsed flags (router/args.py):
``pdserve router`` (router/main.py) and its endpoint-picker mode (router/picker/cli.py)
both build theirs here."""

from __future__ import annotations

import argparse

from pdserve import env
from pdserve.engine.model_source import resolve_model
from pdserve.router.api_keys import read_key_file
from pdserve.router.config import (
    DECODE_FILTERS,
    DECODE_SCORERS,
    PREFILL_FILTERS,
    PREFILL_SCORERS,
    RouterConfig,
    filters,
)
from pdserve.router.discovery.replicas import share
from pdserve.router.discovery.workers import EndpointSource, StaticSource


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The static tenant key (--api-key or its env); --api-key-file is read by the
    router itself (router/api_keys.py), here only checked once so a bad file stops the start."""
    if args.api_key_file:
        _check_key_file("--api-key-file", args.api_key_file)
        return ()
    key = args.api_key or env.get(env.API_KEY)
    return (key,) if key else ()


def admin_keys(args: argparse.Namespace) -> tuple[str, ...]:
    if args.admin_api_key_file:
        _check_key_file("--admin-api-key-file", args.admin_api_key_file)
        return ()
    key = args.admin_api_key or env.get(env.ADMIN_API_KEY)
    return (key,) if key else ()


def _check_key_file(flag: str, path: str) -> None:
    try:
        read_key_file(path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pdserve router: cannot read {flag}: {exc}") from exc


def prefill_scorers(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--scorer pairs, or the defaults."""
    return tuple(args.scorer) or PREFILL_SCORERS


def build_config(
    args: argparse.Namespace, proc_index: int = 0, proc_ports: tuple[int, ...] = ()
) -> RouterConfig:
    n = max(len(proc_ports), 1)  # per-client budgets: each process enforces its share
    return RouterConfig(
        proc_index=proc_index,
        proc_metrics_ports=proc_ports,
        model_dir=resolve_model(args.model, weights=False),
        served_model_name=args.served_model_name,
        picker=args.picker,
        disagg_threshold=args.disagg_threshold,
        scorers=prefill_scorers(args),
        decode_scorer_weights=tuple(args.decode_scorer) or DECODE_SCORERS,
        prefill_filters=filters(args.prefill_filter, PREFILL_FILTERS),
        decode_filters=filters(args.decode_filter, DECODE_FILTERS),
        max_queue=share(args.max_queue, n),
        api_keys=api_keys(args),
        api_key_file=args.api_key_file,
        admin_api_keys=admin_keys(args),
        admin_api_key_file=args.admin_api_key_file,
        admin_port=args.admin_port,
        body_timeout_s=args.body_timeout,
        max_concurrency_per_key=share(args.max_concurrency_per_key, n),
        max_waiting=share(args.max_waiting, n),
        queue_timeout_s=args.queue_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        health_interval_s=args.health_interval,
        stall_timeout_s=args.stall_timeout,
        failover_wait_s=args.failover_wait,
        default_max_tokens=args.default_max_tokens,
        prefix_index_capacity=args.prefix_index_max_blocks,
        prefix_tier_weights=args.prefix_tier_weights,
        max_body_bytes=args.max_body_bytes,
        max_prompt_chars=args.max_prompt_chars,
        max_schema_bytes=args.max_schema_bytes,
        tokenizer_threads=args.tokenizer_threads,
        rate_limit_rpm=share(args.rate_limit_rpm, n),
        rate_limit_tpm=share(args.rate_limit_tpm, n),
        router_replicas=args.router_replicas,
        router_service=router_service(args),
        router_namespace=args.namespace,
        cache_isolation=args.cache_isolation,
        prefill_from_header=args.prefill_from_header,
        pd_handoff=args.pd_handoff,
        loras=tuple(args.lora),
    )


def router_service(args: argparse.Namespace) -> str:
    """The Service whose ready endpoints count the replicas ("" : --router-replicas)."""
    if args.router_service == "none":
        return ""
    if args.router_service:
        return str(args.router_service)
    if args.discovery == "kubernetes" and args.service:
        from pdserve.operator import naming

        return naming.router_service_name(args.service)
    return ""


def build_source(args: argparse.Namespace) -> EndpointSource:
    if args.discovery == "kubernetes":
        from pdserve.router.discovery.k8s import KubernetesSource, current_namespace

        return KubernetesSource(args.service, args.namespace or current_namespace())
    if args.workers_file:
        from pdserve.router.discovery.file import FileSource

        return FileSource(args.workers_file)
    if not args.decode:
        raise SystemExit("pdserve router: static discovery needs at least one --decode URL")
    return StaticSource(args.prefill, args.decode)
