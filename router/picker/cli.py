"""``pdserve router --mode endpoint-picker``: the router's flags, served as ext_proc.

The router's own flags keep their meaning (model, discovery, scorers, the
disaggregation threshold, keys, limits); the picker adds where it listens and what
it names: ``--grpc-port``, ``--fallbacks`` and ``--target-port``; ``--admin-port`` serves
its ``/metrics``. A decode pod's front is the built-in mode with ``--prefill-from-header``
(docs/router.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

from pdserve.router.picker.prefill_header import endpoint_of
from pdserve.router.scheduling.snapshot import WorkerView


def target_of(port: int) -> Callable[[WorkerView], str] | None:
    """The endpoint the gateway dials for a decode worker: its host, ``port``."""
    if not port:
        return None

    def target(w: WorkerView) -> str:
        host = endpoint_of(w.url).rsplit(":", 1)[0]
        return f"{host}:{port}"

    return target


PICKER_ONLY = ("gateway_token_file", "ext_proc_tls_cert", "ext_proc_tls_key", "ext_proc_client_ca")


def refuse_picker_flags(args: argparse.Namespace) -> None:
    """The ext_proc port's guards mean nothing to the built-in router: refused, not ignored."""
    given = [f"--{name.replace('_', '-')}" for name in PICKER_ONLY if getattr(args, name, "")]
    if given:
        raise SystemExit(f"pdserve router: {', '.join(given)} only with --mode endpoint-picker")


def run_picker(args: argparse.Namespace) -> int:
    from pdserve.router.from_args import build_config, build_source
    from pdserve.router.picker.service import ExtProcTLS, PickerService, serve_forever
    from pdserve.router.tokenizer import PromptTokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.fallbacks < 0 or not 0 <= args.target_port < 65536:
        raise SystemExit("pdserve router: --fallbacks must be >= 0 and --target-port a port")
    token = ""
    if args.gateway_token_file:
        try:
            with open(args.gateway_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise SystemExit(f"pdserve router: --gateway-token-file: {exc}") from exc
        if not token:
            raise SystemExit("pdserve router: --gateway-token-file is empty")
    tls = None
    tls_flags = (args.ext_proc_tls_cert, args.ext_proc_tls_key, args.ext_proc_client_ca)
    if any(tls_flags):
        try:
            tls = ExtProcTLS.from_files(*tls_flags)
        except ValueError as exc:
            raise SystemExit(f"pdserve router: {exc}") from exc
    try:
        cfg = build_config(args)
        source = build_source(args)
        tokenizer = PromptTokenizer(cfg.model_dir)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from exc

    async def main() -> None:  # the runtime's HTTP session needs the running loop
        target = target_of(args.target_port)
        service = PickerService(cfg, source, tokenizer, args.fallbacks, target, token, tls)
        await serve_forever(service, args.host, args.grpc_port, args.admin_port)

    try:
        asyncio.run(main())
    except OSError as exc:
        raise SystemExit(f"pdserve router: {exc}") from exc
    return 0
