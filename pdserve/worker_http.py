"""What both worker servers share: flags, errors, and the common routes.

Routes every worker has: ``/health``, ``/metrics``, ``/stats``, ``/abort``.
Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import add_engine_arguments
from pdserve.engine.request import REQUEST_FAILED, RequestFailed
from pdserve.engine.sampling_params import InvalidParameter, SamplingParams, valid_text
from pdserve.jsonguard import BadJSON, loads_checked
from pdserve.worker_metrics import WorkerMetrics

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
MAX_CACHE_SALT_CHARS = 1024


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def add_worker_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    add_engine_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=default_port, help="HTTP port")
    g.add_argument(
        "--advertise-host",
        default=os.environ.get("PDSERVE_ADVERTISE_HOST") or None,
        help="address peers use to reach this worker (default: --host, or the pod IP)",
    )
    g.add_argument("--side-channel-port", type=int, default=None, help="default: port + 2")
    g.add_argument("--worker-id", default=None, help="default: ROLE-HOST-PORT")
    g.add_argument("--kv-transport", default="nixl", choices=["nixl", "tcp"])
    g.add_argument("--log-level", default="info")


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_host:
        return str(args.advertise_host)
    if args.host not in ("0.0.0.0", "::", ""):
        return str(args.host)
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


def worker_id(args: argparse.Namespace, role: str) -> str:
    return args.worker_id or f"{role}-{advertise_host(args)}-{args.port}"


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes", status=413)
    try:
        body = loads_checked(raw)
    except BadJSON as exc:
        raise BadRequest(str(exc), exc.field) from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def request_id_of(body: dict[str, Any]) -> str:
    rid = body.get("request_id") or f"req-{uuid.uuid4().hex}"
    if not isinstance(rid, str) or len(rid) > 256 or not rid.isprintable() or not valid_text(rid):
        raise BadRequest(
            "request_id must be a printable string of at most 256 characters", "request_id"
        )
    return rid


def cache_salt_of(body: dict[str, Any]) -> str | None:
    """The request's prefix-cache salt (the router's tenant salt and the client's
    ``cache_salt``), or None: it enters the block hashes (engine/hashing.py)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if (
        not isinstance(salt, str)
        or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS
        or not valid_text(salt)
    ):
        raise BadRequest(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    return salt


def prompt_of(body: dict[str, Any]) -> list[int]:
    ids = body.get("prompt_token_ids")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise BadRequest("prompt_token_ids must be a list of integers", "prompt_token_ids")
    return ids


def parse_request(body: dict[str, Any]) -> tuple[str, list[int], SamplingParams]:
    """The fields every worker request has: id, prompt token ids, sampling parameters."""
    sampling = body.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise BadRequest("sampling must be an object", "sampling")
    return request_id_of(body), prompt_of(body), SamplingParams.from_dict(sampling)


def run_worker(worker_cls: Any, args: argparse.Namespace) -> int:
    """Load the model, then serve until stopped; ``/health`` is up only once loaded."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    worker = worker_cls(args)
    try:
        serve(worker.app(), args.host, args.port, args.log_level)
    finally:
        worker.close()
    return 0


def add_common_routes(
    app: FastAPI, engine: AsyncEngine, metrics: WorkerMetrics, stats_extra: dict[str, Any]
) -> None:
    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(InvalidParameter)
    async def _invalid(_: Request, exc: InvalidParameter) -> JSONResponse:
        return error_response(400, str(exc), exc.field)

    @app.exception_handler(RequestFailed)
    async def _failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(422, str(exc), None, REQUEST_FAILED)

    @app.get("/livez")
    async def livez() -> JSONResponse:
        return JSONResponse({"status": "alive"})  # liveness: the process; readiness: /health

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return error_response(503, "engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/stats")
    async def stats() -> JSONResponse:
        s = engine.stats()
        e = engine.engine
        return JSONResponse(
            {
                **stats_extra,
                "pid": os.getpid(),
                "model": e.served_model_name,
                "model_id": e.model_id,
                "running": s.running,
                "waiting": s.waiting + s.loading,
                "held": s.held,
                "kv_blocks_free": s.kv_blocks_free,
                "kv_blocks_total": s.kv_blocks_total,
                "queued_prompt_tokens": s.queued_prompt_tokens,
                "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
                "block_size": e.config.block_size,
                "max_model_len": e.max_model_len,
            }
        )

    @app.post("/abort")
    async def abort(request: Request) -> JSONResponse:
        body = await read_json(request)
        rid = body.get("request_id")
        if not isinstance(rid, str):
            raise BadRequest("request_id must be a string", "request_id")
        known = await engine.call(lambda e: rid in e.requests or rid in e.held)
        engine.abort(rid)
        return JSONResponse({"aborted": bool(known)})


def serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
