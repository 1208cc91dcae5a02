"""``pdserve router``: the OpenAI-compatible router, served with uvicorn."""

from __future__ import annotations

import argparse
import logging
import socket
from typing import Any

from pdserve.config_cli import add_flags
from pdserve.router.args import CLIENT_KEEP_ALIVE_S as CLIENT_KEEP_ALIVE_S
from pdserve.router.args import FLAGS as FLAGS
from pdserve.router.config import RouterConfig
from pdserve.router.from_args import build_config as build_config
from pdserve.router.from_args import build_source as build_source
from pdserve.router.picker.cli import refuse_picker_flags, run_picker

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The router's flags (router/args.py) on ``p``."""
    add_flags(p, FLAGS)


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


def run(args: argparse.Namespace) -> int:
    if args.mode == "endpoint-picker":  # an ext_proc service for a gateway, no HTTP API
        return run_picker(args)
    refuse_picker_flags(args)
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
    from pdserve.coalesce import server_config
    from pdserve.router.proxy_headers import FlatProxyHeaders

    # uvloop and httptools by name: "auto" falls back to asyncio's loop and h11 without a
    # word when either is missing, at about twice the CPU per request. httptools with the
    # writes of one loop turn sent together (pdserve/coalesce.py).
    # The proxy header rewrite without a coroutine of its own (router/proxy_headers.py).
    log_level = args.log_level.lower()
    config = server_config(
        app,
        log_level,
        args.keep_alive_timeout,
        loop="uvloop",
        proxy_headers=False,
        interface="asgi3",
    )
    config.app = FlatProxyHeaders(app, config.forwarded_allow_ips)
    # One server on both ports: the app tells the admin port by the request's local port.
    public: tuple[int, ...] = (args.port, args.admin_port) if args.admin_port else (args.port,)
    lane = _fast_lane(args, bool(metrics_socks))
    if lane is not None:  # the lane takes --port; uvicorn serves loopback behind it
        from pdserve.router.fast_lane import LanePeer

        app.state.lane_setup = lane
        config.app = LanePeer(config.app, lane.token, lane.public.getsockname()[:2])
        public = public[1:]
    socks = [_bind(args.host, p, reuse_port=bool(metrics_socks)) for p in public]
    if lane is not None:
        socks.append(lane.backend_socket)  # type: ignore[attr-defined]
    if metrics_socks:  # its own loopback metrics port; the siblings' are theirs
        socks.append(metrics_socks[index])
        for i, s in enumerate(metrics_socks):
            if i != index:
                s.close()
    uvicorn.Server(config).run(sockets=socks)
    return 0


def _fast_lane(args: argparse.Namespace, reuse_port: bool) -> Any:
    """--fast-lane: the lane's sockets, or None (off, or the module is not built: the
    Python lane serves, and says so in the log)."""
    if not args.fast_lane:
        return None
    from pdserve.router import fast_lane

    module = fast_lane.load()
    if module is None:
        return None
    public = _bind(args.host, args.port, reuse_port=reuse_port)
    return fast_lane.setup(module, public, _bind("127.0.0.1", 0))


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
