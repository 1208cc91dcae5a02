"""The decode worker: pulls a prompt's KV from a prefill worker and decodes.

``POST /generate`` with a KV handle admits the request into
``WAITING_FOR_REMOTE_KV``; the connector reads the blocks over NIXL (or tcp)
while the rest of the batch keeps decoding, then the request joins the batch.
Without a handle the worker prefills locally. Output is streamed as NDJSON.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from pdserve.codec import CodecError, from_dict
from pdserve.decode_worker.metered import MeteredConnector
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import engine_config_from_args
from pdserve.engine.request import REQUEST_FAILED, RequestOutput
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord, KVHandle
from pdserve.worker_http import (
    BadRequest,
    add_common_routes,
    add_worker_arguments,
    cache_salt_of,
    parse_request,
    read_json,
    worker_id,
)
from pdserve.worker_metrics import WorkerMetrics

logger = logging.getLogger(__name__)
ROLE = "decode"


class DecodeWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker_id = worker_id(args, ROLE)
        self.engine = AsyncEngine(
            engine_config_from_args(args),
            recompute_on_load_failure=args.on_transfer_failure == "recompute",
        )
        e = self.engine.engine
        self.metrics = WorkerMetrics(self.engine, ROLE)
        remote = RemoteKVConnector(
            e.pool.tensor,
            CompatRecord.for_pool(e.pool.tensor, e.model_id),
            transport=args.kv_transport,
            transfer_timeout=args.transfer_timeout,
        )
        self.connector = MeteredConnector(remote, self.metrics, remote.transport_name)
        e.attach_connector(self.connector)

    def stats_extra(self) -> dict[str, Any]:
        return {
            "role": ROLE,
            "worker_id": self.worker_id,
            "kv_transport": self.args.kv_transport,
        }

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        rid, prompt, params = parse_request(body)
        kwargs: dict[str, Any] = {"cache_salt": cache_salt_of(body)}
        if body.get("kv_handle") is not None:
            kwargs["remote_kv"] = self._handle(body["kv_handle"])
            kwargs["first_token_id"] = body.get("first_token_id")
            if not isinstance(kwargs["first_token_id"], int):
                raise BadRequest("a kv_handle needs an integer first_token_id", "first_token_id")
        elif body.get("resume_token_ids"):  # a stream migrated off a worker that died
            kwargs["resume_token_ids"] = body["resume_token_ids"]
            if not isinstance(kwargs["resume_token_ids"], list):
                raise BadRequest("resume_token_ids must be a list", "resume_token_ids")
        outputs = self.engine.generate(rid, prompt, params, **kwargs)
        first = await anext(outputs)  # validation errors surface here, before any byte is sent
        return self._lines(first, outputs)

    def _handle(self, body: Any) -> KVHandle:
        if not isinstance(body, dict):
            raise BadRequest("kv_handle must be an object", "kv_handle")
        try:
            handle = from_dict(body, KVHandle)
        except CodecError as exc:
            raise BadRequest(f"invalid kv_handle: {exc}", "kv_handle") from exc
        if handle.transport != self.args.kv_transport:
            raise BadRequest(
                f"kv_handle is for transport {handle.transport!r}; this worker uses "
                f"{self.args.kv_transport!r}",
                "kv_handle",
            )
        return handle

    async def _lines(
        self, first: RequestOutput, rest: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[bytes]:
        out: RequestOutput | None = first
        while out is not None:
            yield self._line(out)
            if out.finished:
                self.metrics.requests.labels(ROLE, out.finish_reason).inc()
                return
            out = await anext(rest, None)

    @staticmethod
    def _line(out: RequestOutput) -> bytes:
        body: dict[str, Any]
        if out.finish_reason == "error":
            # request_failed: this request alone failed (the router does not retry it)
            request_fault = out.error_code == REQUEST_FAILED
            body = {
                "error": {
                    "message": out.error,
                    "type": "invalid_request_error" if request_fault else "server_error",
                    "param": None,
                    "code": out.error_code or "kv_transfer_failed",
                }
            }
        else:
            body = {
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
            }
            if out.logprobs is not None:
                body["logprobs"] = out.logprobs
            if out.finished:
                body["usage"] = out.usage
        return (json.dumps(body) + "\n").encode()

    def app(self) -> FastAPI:
        app = FastAPI(title="pdserve decode worker")
        add_common_routes(app, self.engine, self.metrics, self.stats_extra())

        @app.post("/generate")
        async def generate(request: Request) -> StreamingResponse:
            lines = await self.generate(await read_json(request))
            return StreamingResponse(lines, media_type="application/x-ndjson")

        return app

    def close(self) -> None:
        self.engine.shutdown()
        self.connector.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, default_port=8200)
    g = parser.add_argument_group("decode")
    g.add_argument("--transfer-timeout", type=float, default=10.0, help="seconds per KV read")
    g.add_argument(
        "--on-transfer-failure",
        default="recompute",
        choices=["recompute", "fail"],
        help="recompute the prompt locally, or fail the request",
    )
