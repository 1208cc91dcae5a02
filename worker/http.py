"""What both worker servers share: flags, errors, authentication and the common routes.

Routes every worker has: ``/livez``, ``/health``, ``/metrics``, ``/stats``, ``/abort``.
Bodies are the typed messages of :mod:`pdserve.protocol.contract`. Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``. With ``PDSERVE_SERVICE_SECRET`` set,
every route but ``/livez``, ``/health`` and ``/metrics`` needs it in ``X-PDServe-Secret``
(401 otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve import env, keys
from pdserve.jsonguard import BadJSON, loads_checked
from pdserve.protocol.codec import CodecError, from_dict, to_dict
from pdserve.protocol.contract import AbortReply, RequestRef, WorkerStats
from pdserve.protocol.outputs import REQUEST_FAILED, EngineDeadError, RequestFailed
from pdserve.protocol.sampling_params import InvalidParameter
from pdserve.worker.auth import CallCheck, with_proof
from pdserve.worker.core.client import EngineClient
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.metrics import WorkerMetrics

T = TypeVar("T")

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def add_worker_arguments(parser: argparse.ArgumentParser, decode: bool = False) -> None:
    """A worker's flags (worker/args.py): the prefill worker's, or with ``decode`` the decode
    worker's."""
    from pdserve.config_cli import add_flags
    from pdserve.worker.args import FLAGS_DECODE, FLAGS_PREFILL

    add_flags(parser, FLAGS_DECODE if decode else FLAGS_PREFILL)


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host or env.get(env.ADVERTISE_HOST):
        return str(args.advertise_host or env.get(env.ADVERTISE_HOST))
    if args.host not in ("0.0.0.0", "::", ""):
        return str(args.host)
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


def worker_id(args: argparse.Namespace, role: str) -> str:
    return args.worker_id or f"{role}-{advertise_host(args)}-{args.port}"


def core_config(role: str, args: argparse.Namespace) -> CoreConfig:
    """What the worker's engine core is started with (sent to it pickled)."""
    return CoreConfig.from_args(role, args, advertise_host(args), worker_id(args, role))


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


async def read_message(request: Request, cls: type[T]) -> T:
    """The body as a typed message of ``cls``; a 400 naming the field if it is not one."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        body = loads_checked(raw)  # depth-limited (pdserve/jsonguard.py)
    except BadJSON as exc:
        raise BadRequest(str(exc), exc.field) from exc
    try:
        return from_dict(body, cls)
    except CodecError as exc:
        raise BadRequest(str(exc), exc.field) from exc


def known_error(exc: Exception) -> JSONResponse | None:
    """The OpenAI error body for a request error (None: not one): the app's exception
    handlers and the direct lane (worker/direct.py) answer with it."""
    if isinstance(exc, BadRequest):
        return error_response(exc.status, str(exc), exc.param, exc.code)
    if isinstance(exc, InvalidParameter):
        # The request's LoRA adapter is not this worker's (unknown here, another hash, or
        # not the one its KV handle was computed under): never served under other weights.
        code = "lora_mismatch" if exc.field == "lora" else None
        return error_response(400, str(exc), exc.field, code)
    if isinstance(exc, RequestFailed):
        return error_response(422, str(exc), None, REQUEST_FAILED)
    if isinstance(exc, EngineDeadError):  # a worker fault: the router tries another
        return error_response(503, str(exc), None, "engine_dead")
    return None


def reply(msg: Any) -> JSONResponse:
    return JSONResponse(to_dict(msg))


class SecretCheck:
    """ASGI middleware: every route but the open ones takes only calls signed with the
    service secret (pdserve/signing.py; ``secret``: the signing one, then one also accepted
    while rotating), and the replies to signed calls prove the secret. Pure ASGI, so
    streamed responses pass through untouched."""

    OPEN = frozenset({"/livez", "/health", "/metrics"})

    def __init__(self, app: ASGIApp, secret: str | tuple[str, ...]) -> None:
        self.app = app
        self.check = CallCheck(keys.KeyRing(keys.HTTP, secret), refusal)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            checked = await self.check(scope, receive, send, scope["path"] not in self.OPEN)
            if checked is None:
                return
            receive, proof = checked
            if proof is not None:
                send = with_proof(send, proof)
        await self.app(scope, receive, send)


def refusal(status: int, why: str) -> JSONResponse:
    """The answer to a call that is not the router's (401) or too big to check (413)."""
    if status == 401:
        return error_response(
            401, f"unauthorized: {why} (this is an internal endpoint)", code="unauthorized"
        )
    return error_response(status, why)


GIL_SWITCH_INTERVAL_S = 0.0005
CORE_DEATH_GRACE_S = 2.0  # the failed streams' last lines go out, then the worker exits


def run_worker(worker_cls: Any, args: argparse.Namespace) -> int:
    """Load the model, then serve until stopped; ``/health`` is up only once loaded."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    # The thread that receives the engine core's outputs waits for the GIL while the
    # HTTP loop runs Python: up to the switch interval (5 ms by default, most of a
    # decode step on a small model) before a step's tokens move on. A short one bounds it.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        worker = worker_cls(args)
    except RuntimeError as exc:  # the core refused the model (its probe) or died loading it
        logger.error("%s worker: not started: %s", getattr(worker_cls, "ROLE", ""), exc)
        return 1
    # Torch's and the app's objects stay alive for good: keep them out of the collector's
    # full passes (the engine core does the same for the model: worker/core/main.py).
    gc.collect()
    gc.freeze()
    http = server(worker.app(), args.host, args.port, args.log_level)
    # A worker whose engine core died cannot serve again: it ends its streams with an
    # error (the router migrates them), then exits for its supervisor to restart it.
    worker.engine.on_death = lambda: threading.Timer(
        CORE_DEATH_GRACE_S, setattr, (http, "should_exit", True)
    ).start()
    try:
        http.run()
    finally:
        worker.close()
    if worker.engine.crashed:
        logger.error("exiting: %s", worker.engine.crashed)
        return 1
    return 0


def add_common_routes(
    app: FastAPI,
    engine: EngineClient,
    metrics: WorkerMetrics,
    identity: dict[str, Any],
    on_abort: Callable[[str], bool] = lambda rid: False,
) -> None:
    """``identity``: the ``WorkerStats`` fields that say who the worker is; ``on_abort``:
    the role's own part of an abort (True: it knew the request)."""
    if env.service_secret(f"the {identity.get('role', '')} worker"):
        app.add_middleware(SecretCheck, secret=keys.secrets_from_env())

    async def _known(_: Request, exc: Exception) -> JSONResponse:
        response = known_error(exc)
        assert response is not None
        return response

    for cls in (BadRequest, InvalidParameter, RequestFailed, EngineDeadError):
        app.add_exception_handler(cls, _known)

    @app.get("/livez")
    async def livez() -> JSONResponse:
        return JSONResponse({"status": "alive"})  # liveness: the process; readiness: /health

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return error_response(503, "engine is not running")
        if not engine.responsive:  # hung: the router moves this worker's streams
            return error_response(503, f"engine core silent for {engine.silent_s:.0f}s")
        stats = engine.stats()
        if stats.fault:  # a step raised: out of service until its probe passes again
            return error_response(503, f"engine step failed: {stats.fault}")
        return JSONResponse({"status": "ok", "compile": stats.compile})

    @app.get("/metrics")
    async def prometheus() -> Response:
        # The core's families (KV transfers, leases) are disjoint from the front end's.
        core = await engine.query("metrics") if engine.alive else b""
        return Response(metrics.render() + core, media_type="text/plain; version=0.0.4")

    info = engine.info
    fixed = {
        **identity,
        "pid": os.getpid(),
        "core_pid": engine.proc.pid,
        "model": info["model"],
        "model_id": info["model_id"],
        "block_size": info["block_size"],
        "max_model_len": info["max_model_len"],
    }

    @app.get("/stats")
    async def stats() -> JSONResponse:
        return reply(WorkerStats(**dataclasses.asdict(engine.stats()), **fixed))

    @app.post("/abort")
    async def abort(request: Request) -> JSONResponse:
        rid = (await read_message(request, RequestRef)).request_id
        mine = on_abort(rid)
        known = await engine.query("known", rid)
        engine.abort(rid)
        return reply(AbortReply(bool(known) or mine))


# Seconds an idle keep-alive connection stays open. uvicorn's default (5 s) is far below
# the router's pool (pdserve/worker_calls/worker_client.py: POOL_KEEPALIVE_S, 60 s): the worker
# closed connections the router was just reusing, and when load fell (as before a scale-down)
# requests failed on healthy workers. The server must outlast its client.
KEEP_ALIVE_S = 120


def server(app: FastAPI, host: str, port: int, log_level: str) -> Any:
    """The uvicorn server of ``app`` (``.run()`` serves; ``.should_exit = True`` ends it
    gracefully from any thread)."""
    import uvicorn

    from pdserve.coalesce import server_config

    # A loop turn's writes in one send, as the router's server does (pdserve/coalesce.py): a
    # prefill reply's head and body reach the router in one segment, a read and a wake-up
    # less for it per request, and a stream's last line leaves with its end.
    config = server_config(app, log_level, KEEP_ALIVE_S, host=host, port=port)
    return uvicorn.Server(config)
