"""``pdserve router``: the OpenAI-compatible router, served with uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket

from pdserve import env
from pdserve.config_cli import add_flags
from pdserve.engine.model_source import resolve_model
from pdserve.router.api_keys import read_key_file
from pdserve.router.args import CLIENT_KEEP_ALIVE_S as CLIENT_KEEP_ALIVE_S
from pdserve.router.args import FLAGS as FLAGS
from pdserve.router.config import DECODE_SCORERS, PREFILL_SCORERS, RouterConfig
from pdserve.router.discovery.replicas import share
from pdserve.router.discovery.workers import EndpointSource, StaticSource
from pdserve.router.picker.cli import run_picker

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The router's flags (router/args.py) on ``p``."""
    add_flags(p, FLAGS)


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


def warn_if_open(cfg: RouterConfig, host: str) -> None:
    """A router on a non-loopback address without API keys serves anyone who reaches it."""
    if cfg.api_keys or cfg.api_key_file:
        return
    if host in ("127.0.0.1", "::1", "localhost") or host.startswith("127."):
        return
    log.warning(
        "no API key is configured and the router listens on %s: anyone who can "
        "reach it can use it and read /metrics and /workers (--api-key-file)",
        host,
    )


def prefill_scorers(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--scorer pairs, or the defaults."""
    return tuple(args.scorer) or PREFILL_SCORERS


def num_procs(args: argparse.Namespace) -> int:
    from pdserve.router.procs import cpu_limit

    if args.procs == "auto":
        return cpu_limit()
    try:
        n = int(args.procs)
    except ValueError:
        n = 0
    if n < 1:
        raise SystemExit(
            f"pdserve router: --procs must be 'auto' or at least 1, not {args.procs!r}"
        )
    return n


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


def run(args: argparse.Namespace) -> int:
    if args.mode == "endpoint-picker":  # an ext_proc service for a gateway, no HTTP API
        return run_picker(args)
    n = num_procs(args)
    if n == 1:
        return serve(args, 0, [])
    from pdserve.router.procs import supervise

    return supervise(args, n, serve)


def serve(args: argparse.Namespace, index: int, metrics_socks: list[socket.socket]) -> int:
    """One router process: process ``index`` of ``len(metrics_socks)`` (none: the only one)."""
    import uvicorn

    from pdserve.router.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    ports = tuple(int(s.getsockname()[1]) for s in metrics_socks)
    try:
        cfg = build_config(args, index, ports)
        source = build_source(args)
        app = create_app(cfg, source)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from exc
    warn_if_open(cfg, args.host)
    if args.keep_alive_timeout < 1:
        raise SystemExit("pdserve router: --keep-alive-timeout must be at least 1 second")
    from pdserve.router.coalesce import CoalescingHttpTools
    from pdserve.router.proxy_headers import FlatProxyHeaders

    # uvloop and httptools by name: "auto" falls back to asyncio's loop and h11 without a
    # word when either is missing, at about twice the CPU per request. httptools with the
    # writes of one loop turn sent together (router/coalesce.py).
    # The proxy header rewrite without a coroutine of its own (router/proxy_headers.py).
    config = uvicorn.Config(
        app,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_keep_alive=args.keep_alive_timeout,
        loop="uvloop",
        http=CoalescingHttpTools,
        proxy_headers=False,
        interface="asgi3",
    )
    config.app = FlatProxyHeaders(app, config.forwarded_allow_ips)
    # One server on both ports: the app tells the admin port by the request's local port.
    public = (args.port, args.admin_port) if args.admin_port else (args.port,)
    socks = [_bind(args.host, p, reuse_port=bool(metrics_socks)) for p in public]
    if metrics_socks:  # its own loopback metrics port; the siblings' are theirs
        socks.append(metrics_socks[index])
        for i, s in enumerate(metrics_socks):
            if i != index:
                s.close()
    uvicorn.Server(config).run(sockets=socks)
    return 0


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # several processes on one port: the kernel spreads the connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise SystemExit(f"pdserve router: cannot listen on {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock
