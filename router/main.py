"""``pdserve router``: the OpenAI-compatible router, served with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import socket

from pdserve import env
from pdserve.engine.model_source import resolve_model
from pdserve.router.api.adapters import parse_lora
from pdserve.router.config import (
    CACHE_ISOLATION,
    DECODE_SCORERS,
    PD_HANDOFFS,
    PICKERS,
    PREFILL_SCORERS,
    ROUTING_MODES,
    RouterConfig,
    parse_scorer,
)
from pdserve.router.discovery.replicas import share
from pdserve.router.discovery.workers import EndpointSource, StaticSource
from pdserve.router.keys import read_key_file
from pdserve.router.picker.cli import add_picker_arguments, run_picker

API_KEY_ENV = env.API_KEY
ADMIN_KEY_ENV = "PDSERVE_ADMIN_API_KEY"
# Seconds an idle client connection stays open. uvicorn's default, 5 s, equals httpx's
# pool expiry (the OpenAI SDK's) and is below aiohttp's 15 s: a client reused connections
# the router was closing at that moment and the request failed ("Server disconnected":
# 3 of 160 requests of a client pausing ~5 s between bursts, here). Longer than common client pools
# (Go's 90 s) and load balancers' idle timeouts (60 s), so the client side gives up first.
CLIENT_KEEP_ALIVE_S = 120
log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model dir (tokenizer + config) or FILE.gguf")
    p.add_argument("--served-model-name", default="", help="name clients use (default: dir name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL",
                   help="prefill worker URLs")  # fmt: skip
    p.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                   help="decode worker URLs")  # fmt: skip
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    p.add_argument("--workers-file", default="",
                   help='JSON {"prefill": [URL], "decode": [URL]}, re-read on change '
                   "(static discovery; used by pdserve up --autoscale)")  # fmt: skip
    p.add_argument("--service", default="", help="LLMService name (kubernetes discovery)")
    p.add_argument("--namespace", default="", help="namespace (default: the pod's own)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default="", help=f"required bearer key (or env {API_KEY_ENV})")
    keys.add_argument("--api-key-file", default="",
                      help="file with one API key per line, optionally 'KEY priority=N'; "
                      "re-read when it changes")  # fmt: skip
    admin = p.add_mutually_exclusive_group()
    admin.add_argument("--admin-api-key", default="",
                       help="key that opens /metrics and /workers while API keys are on "
                       f"(or env {ADMIN_KEY_ENV})")  # fmt: skip
    admin.add_argument("--admin-api-key-file", default="", help="file of admin keys")
    p.add_argument("--admin-port", type=int, default=0,
                   help="a second port (on --host) where /metrics and /workers need no key; "
                   "keep it off the tenants' network (0: none)")  # fmt: skip
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests in flight; beyond them they wait (--max-waiting)")  # fmt: skip
    add_limit_arguments(p)
    p.add_argument("--picker", choices=PICKERS, default="max-score")
    p.add_argument("--routing", choices=ROUTING_MODES, default="prefix",
                   help="older form of --picker: prefix = max-score")  # fmt: skip
    p.add_argument("--disagg-threshold", type=int, default=256,
                   help="uncached prompt tokens below which decode prefills locally")  # fmt: skip
    p.add_argument("--pd-handoff", choices=PD_HANDOFFS, default="router",
                   help="who calls the prefill worker: the router (then the decode worker "
                   "with the KV handle), or the decode worker, named the prefill workers "
                   "to use (one call per request at the router; docs/router.md)")  # fmt: skip
    pairs = ", ".join(f"{n}={w:g}" for n, w in PREFILL_SCORERS)
    p.add_argument("--scorer", action="append", type=_scorer, default=[], metavar="NAME=WEIGHT",
                   help=f"a prefill scorer and its weight, repeated (default {pairs})")  # fmt: skip
    pairs = ", ".join(f"{n}={w:g}" for n, w in DECODE_SCORERS)
    p.add_argument("--decode-scorer", action="append", type=_scorer, default=[],
                   metavar="NAME=WEIGHT", help=f"a decode scorer (default {pairs})")  # fmt: skip
    for name in ("prefix", "load", "balance"):  # older flags: --scorer NAME=W
        p.add_argument(f"--{name}-weight", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--lora", action="append", type=_lora, default=[], metavar="NAME=PATH",
                   help="a LoRA adapter served as model NAME (repeatable); its files are "
                   "hashed here, and the workers get the same --lora")  # fmt: skip
    p.add_argument("--prefix-index-max-blocks", type=int, default=1_000_000,
                   help="block hashes the prefix index remembers, all workers together; "
                   "beyond them the least recently used are forgotten (~200 B each)")  # fmt: skip
    p.add_argument("--prefix-tier-weights", default="host=0.8,disk=0.5,shared=0.3",
                   help="what a prefix hit in a prefill worker's KV tier is worth (the "
                   "pool's is 1); a prefix in the shared tier is a hit on every prefill "
                   "worker")  # fmt: skip
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks")
    p.add_argument("--stall-timeout", type=float, default=10.0,
                   help="seconds a decode stream or prefill may wait for a worker that fails "
                        "its health check before it moves to another worker")  # fmt: skip
    p.add_argument("--failover-wait", type=float, default=30.0,
                   help="seconds a request whose decode workers all failed waits for one to "
                        "come back (a restart) before it fails; 0: no wait")  # fmt: skip
    p.add_argument("--keep-alive-timeout", type=int, default=CLIENT_KEEP_ALIVE_S,
                   help="seconds an idle client connection stays open (longer than clients "
                        "and load balancers keep theirs: docs/router.md)")  # fmt: skip
    p.add_argument("--log-level", default="info")
    add_picker_arguments(p)
    p.add_argument("--procs", default="1",
                   help="router processes on the port (SO_REUSEPORT), each with the full "
                   "view; 'auto': the CPU limit (docs/router.md)")  # fmt: skip


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits at the edge (docs/router.md)")
    g.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body; larger is a 413 (default 8 MiB)")  # fmt: skip
    g.add_argument("--max-prompt-chars", type=int, default=1 << 20,
                   help="longest prompt text (all messages together) to tokenize")  # fmt: skip
    g.add_argument("--max-schema-bytes", type=int, default=64 << 10,
                   help="largest structured-output spec (JSON schema, regex, grammar, the "
                   "tools of tool_choice required); larger is a 400")  # fmt: skip
    g.add_argument("--tokenizer-threads", type=int, default=2,
                   help="threads that parse and tokenize requests off the event loop")  # fmt: skip
    g.add_argument("--rate-limit-rpm", type=int, default=0,
                   help="requests per minute per API key (0: no limit); beyond it 429")  # fmt: skip
    g.add_argument("--rate-limit-tpm", type=int, default=0,
                   help="prompt + max_tokens per minute per API key (0: no limit)")  # fmt: skip
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; then 408 (no slot is "
                   "held meanwhile)")  # fmt: skip
    g.add_argument("--router-replicas", type=int, default=1,
                   help="router replicas that split the per-key budgets (rate limits, "
                        "--max-concurrency-per-key): each enforces 1/N")  # fmt: skip
    g.add_argument("--router-service", default=None,
                   help="kubernetes: the router's own Service, its ready endpoints the "
                        "replica count (default: the LLMService's; 'none': use "
                        "--router-replicas)")  # fmt: skip
    g.add_argument("--max-concurrency-per-key", type=int, default=0,
                   help="requests one API key may have in flight or waiting (0: off)")  # fmt: skip
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests that wait for a slot beyond --max-queue, fairly across "
                   "keys (0: a full queue is a 429 at once)")  # fmt: skip
    g.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request waits for a slot before its 429")  # fmt: skip
    g.add_argument("--stream-write-timeout", type=float, default=30.0,
                   help="seconds a stream may wait for its client to read; then it is "
                   "aborted and its KV freed (a slow reader)")  # fmt: skip
    g.add_argument("--cache-isolation", choices=CACHE_ISOLATION, default="api-key",
                   help="api-key: each API key has its own prefix cache (cached_tokens reveal "
                   "nothing across keys); none: one cache shared by all")  # fmt: skip


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The static tenant key (--api-key or its env); --api-key-file is read by the
    router itself (router/keys.py), here only checked once so a bad file stops the start."""
    if args.api_key_file:
        _check_key_file("--api-key-file", args.api_key_file)
        return ()
    key = args.api_key or env.get(API_KEY_ENV)
    return (key,) if key else ()


def admin_keys(args: argparse.Namespace) -> tuple[str, ...]:
    if args.admin_api_key_file:
        _check_key_file("--admin-api-key-file", args.admin_api_key_file)
        return ()
    key = args.admin_api_key or os.environ.get(ADMIN_KEY_ENV, "")
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
    log.warning("no API key is configured and the router listens on %s: anyone who can "
                "reach it can use it and read /metrics and /workers (--api-key-file)",
                host)  # fmt: skip


def _lora(text: str) -> tuple[str, str]:
    try:
        return parse_lora(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _scorer(text: str) -> tuple[str, float]:
    try:
        return parse_scorer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def prefill_scorers(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--scorer pairs (or the defaults), then the older --NAME-weight flags on top."""
    pairs = list(args.scorer) or list(PREFILL_SCORERS)
    for name in ("prefix", "load", "balance"):
        weight = getattr(args, f"{name}_weight")
        if weight is not None:
            pairs.append((name, weight))
    return tuple(pairs)


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
        routing=args.routing,
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
    config = uvicorn.Config(app, log_level=args.log_level.lower(), access_log=False,
                            timeout_keep_alive=args.keep_alive_timeout, loop="uvloop",
                            http=CoalescingHttpTools, proxy_headers=False,
                            interface="asgi3")  # fmt: skip
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
