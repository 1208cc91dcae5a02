"""The router's configuration and worker source from its parsed flags (router/args.py):
``pdserve router`` (router/main.py) and its endpoint-picker mode (router/picker/cli.py)
both build theirs here."""

from __future__ import annotations

import argparse
from typing import Any

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
from pdserve.router.peer_budgets import KUBERNETES, base_url
from pdserve.router.peer_list import PREFIX, read_peers
from pdserve.router.shared_limits import installed


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
    n = max(len(proc_ports), 1)  # the slots: each process has its share
    if n > 1 and installed() is None and any(getattr(args, f) for f in BUDGETS):
        raise ValueError("per-client budgets over --procs need the shared table (procs.py)")
    copied: dict[str, Any] = {field: getattr(args, flag) for field, flag in COPIED.items()}
    copied.update({field: getattr(args, field) for field in BUDGETS})
    shares: dict[str, Any] = {field: share(getattr(args, field), n) for field in SHARED}
    return RouterConfig(
        proc_index=proc_index,
        proc_metrics_ports=proc_ports,
        model_dir=resolve_model(args.model, weights=False),
        scorers=prefill_scorers(args),
        decode_scorer_weights=tuple(args.decode_scorer) or DECODE_SCORERS,
        prefill_filters=filters(args.prefill_filter, PREFILL_FILTERS),
        decode_filters=filters(args.decode_filter, DECODE_FILTERS),
        api_keys=api_keys(args),
        admin_api_keys=admin_keys(args),
        router_service=router_service(args),
        budget_peers=budget_peers(args),
        budget_self=args.budget_self or "",
        loras=tuple(args.lora),
        **copied,
        **shares,
    )


# RouterConfig fields that are a flag's value as it is (field -> the flag's dest)...
COPIED = {
    name: name
    for name in (
        *("served_model_name", "picker", "disagg_threshold", "api_key_file", "admin_port"),
        *("admin_api_key_file", "default_max_tokens", "prefix_tier_weights", "max_body_bytes"),
        *("max_prompt_chars", "max_schema_bytes", "tokenizer_threads", "router_replicas"),
        *("cache_isolation", "prefill_from_header", "pd_handoff"),
    )
} | {
    "body_timeout_s": "body_timeout",
    "queue_timeout_s": "queue_timeout",
    "stream_write_timeout_s": "stream_write_timeout",
    "health_interval_s": "health_interval",
    "stall_timeout_s": "stall_timeout",
    "failover_wait_s": "failover_wait",
    "prefix_index_capacity": "prefix_index_max_blocks",
    "router_namespace": "namespace",
}
# ...the capacity, which --procs N processes split (each has its share of the slots)...
SHARED = ("max_queue", "max_waiting")
# ...and the per-client budgets, the replica's whole: its processes share one table of
# counters and buckets (router/shared_limits.py) instead of rounding a split up.
BUDGETS = ("max_concurrency_per_key", "rate_limit_rpm", "rate_limit_tpm")


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


def budget_peers(args: argparse.Namespace) -> tuple[str, ...]:
    """--budget-peers: the replicas' URLs (checked here: a bad one stops the start), or
    ("kubernetes",) for the router Service's endpoints."""
    given = (args.budget_peers or "").strip()
    if given == KUBERNETES:
        if args.discovery != "kubernetes" or not router_service(args) or not args.admin_port:
            raise SystemExit(
                "pdserve router: --budget-peers kubernetes needs --discovery kubernetes, "
                "the router Service and --admin-port"
            )
        return (KUBERNETES,)
    if given.startswith(PREFIX):  # a file of URLs, re-read when it changes
        if not args.budget_self:
            raise SystemExit("pdserve router: --budget-peers @FILE needs --budget-self")
        try:
            read_peers(given[1:])
            base_url(args.budget_self)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"pdserve router: --budget-peers {given}: {exc}") from exc
        return (given,)
    peers = tuple(p.strip() for p in given.split(",") if p.strip())
    if peers and not args.budget_self:
        raise SystemExit("pdserve router: --budget-peers needs --budget-self (this replica)")
    try:
        listed = {base_url(url) for url in peers}
        if peers and base_url(args.budget_self) not in listed:
            raise ValueError(f"--budget-self {args.budget_self} is not in --budget-peers")
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from exc
    return peers


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
