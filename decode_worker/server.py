"""The decode worker: pulls a prompt's KV from a prefill worker and decodes.

``POST /generate`` with a KV handle admits the request into
``WAITING_FOR_REMOTE_KV``; the connector reads the blocks over NIXL (or tcp)
while the rest of the batch keeps decoding, then the request joins the batch.
Without a handle the worker prefills locally. Output is streamed as NDJSON.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve import env, keys
from pdserve.protocol.codec import encode
from pdserve.protocol.contract import GenerateRequest, TokenDelta, Usage, WorkerError
from pdserve.protocol.outputs import REQUEST_FAILED, RequestOutput
from pdserve.protocol.token_lines import encode_line
from pdserve.transfer.registry import DEFAULT_TRANSFER_TIMEOUT
from pdserve.worker.direct import DirectApp, LineStream
from pdserve.worker.http import (
    add_common_routes,
    add_worker_arguments,
    known_error,
    read_message,
)
from pdserve.worker.lora_api import add_lora_routes
from pdserve.worker.role import RoleWorker, add_kv_events_port


class DecodeWorker(RoleWorker):
    # The engine and its KV connector run in a child process (decode_worker/core.py).
    ROLE = "decode"

    def identity(self) -> dict[str, Any]:
        return {
            **super().identity(),
            "kv_transport": self.args.kv_transport,
            "kv_events": self.engine.info.get("kv_events", ""),  # its load reports
        }

    async def generate(self, req: GenerateRequest) -> AsyncIterator[bytes]:
        kwargs: dict[str, Any] = {"cache_salt": req.cache_salt, "lora": req.lora}
        if req.kv_handle is not None:  # checked by the engine (KVHandle.problem)
            kwargs.update(remote_kv=req.kv_handle, first_token_id=req.first_token_id)
        elif req.resume_token_ids:  # a stream migrated off a worker that died
            kwargs["resume_token_ids"] = req.resume_token_ids
        outputs = self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling, **kwargs)
        first = await anext(outputs)  # validation errors surface here, before any byte is sent
        return self._lines(first, outputs)

    async def _lines(
        self, first: RequestOutput, rest: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[bytes]:
        out: RequestOutput | None = first
        while out is not None:
            yield self._line(out)
            if out.finished:
                self.metrics.requests.labels(self.ROLE, out.finish_reason).inc()
                return
            out = await anext(rest, None)

    @staticmethod
    def _line(out: RequestOutput) -> bytes:
        if out.finish_reason == "error":
            # request_failed: this request alone failed (the router does not retry it)
            request_fault = out.error_code == REQUEST_FAILED
            kind = "invalid_request_error" if request_fault else "server_error"
            error = WorkerError(out.error, kind, None, out.error_code or "kv_transfer_failed")
            return encode(TokenDelta(error=error)) + b"\n"
        usage = Usage(**out.usage) if out.finished else None
        return encode_line(out.token_ids, out.text, out.finish_reason, usage, out.logprobs,
                           out.prompt_logprobs)  # fmt: skip

    def app(self) -> FastAPI:
        # The stream goes out through the direct lane (worker/direct.py): one send per
        # line, nothing between it and the server.
        secrets = keys.secrets_from_env() if env.service_secret("the decode worker") else ()
        app = DirectApp(secrets, known_error, title="pdserve decode worker")
        add_common_routes(app, self.engine, self.metrics, self.identity())
        add_lora_routes(app, self.engine)

        async def generate(request: Request) -> Response:
            lines = await self.generate(await read_message(request, GenerateRequest))
            return LineStream(lines, media_type="application/x-ndjson")

        app.add_direct("POST", "/generate", generate)
        return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, default_port=8200)
    g = parser.add_argument_group("decode")
    add_kv_events_port(g, "its load reports' ZeroMQ port (default: port + 1)")
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=DEFAULT_TRANSFER_TIMEOUT,
        help="seconds per KV load (claim, read, confirm)",
    )
    g.add_argument(
        "--on-transfer-failure",
        default="recompute",
        choices=["recompute", "fail"],
        help="recompute the prompt locally, or fail the request",
    )
