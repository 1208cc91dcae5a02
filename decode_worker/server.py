"""The decode worker: pulls a prompt's KV from a prefill worker and decodes.

``POST /generate`` with a KV handle admits the request into
``WAITING_FOR_REMOTE_KV``; the connector reads the blocks over NIXL (or tcp)
while the rest of the batch keeps decoding, then the request joins the batch.
Without a handle the worker prefills locally. Output is streamed as NDJSON. With
``prefill`` (the router's ``--pd-handoff decode``) this worker calls the prefill worker
itself and streams its first token first (decode_worker/chain.py).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdserve import env, keys
from pdserve.decode_worker.chain import PrefillChain
from pdserve.protocol.codec import encode
from pdserve.protocol.contract import (
    GenerateRequest,
    PrefillReply,
    TokenDelta,
    Usage,
    WorkerError,
)
from pdserve.protocol.outputs import REQUEST_FAILED, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter
from pdserve.protocol.token_lines import encode_line
from pdserve.worker.direct import DirectApp, LineStream
from pdserve.worker.http import (
    BadRequest,
    add_common_routes,
    add_worker_arguments,
    known_error,
    read_message,
)
from pdserve.worker.lora_api import add_lora_routes
from pdserve.worker.role import RoleWorker


class DecodeWorker(RoleWorker):
    # The engine and its KV connector run in a child process (worker/core/decode.py).
    ROLE = "decode"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.chain = PrefillChain(args.prefill_timeout, count=self._count_prefill)
        self._chaining: dict[str, asyncio.Task[Any]] = {}  # request id -> its prefill wait

    def _count_prefill(self, outcome: str) -> None:
        self.metrics.prefill_calls.labels(self.ROLE, outcome).inc()

    def identity(self) -> dict[str, Any]:
        return {
            **super().identity(),
            "kv_transport": self.args.kv_transport,
            "kv_events": self.engine.info.get("kv_events", ""),  # its load reports
        }

    async def generate(self, req: GenerateRequest) -> AsyncIterator[bytes]:
        if req.prefill:
            return await self._chained(req)
        return await self._run(req)

    async def _run(self, req: GenerateRequest, cached: int | None = None) -> AsyncIterator[bytes]:
        """The engine's stream of ``req`` as lines; ``cached``: a chained request's cached
        prompt tokens, reported in place of this worker's (``_line``)."""
        kwargs: dict[str, Any] = {"cache_salt": req.cache_salt, "lora": req.lora}
        if req.kv_handle is not None:  # checked by the engine (KVHandle.problem)
            kwargs.update(remote_kv=req.kv_handle, first_token_id=req.first_token_id)
        elif req.resume_token_ids:  # a stream migrated off a worker that died
            kwargs["resume_token_ids"] = req.resume_token_ids
        outputs = self.engine.generate(req.request_id, req.prompt_token_ids, req.sampling, **kwargs)
        first = await anext(outputs)  # validation errors surface here, before any byte is sent
        return self._lines(first, outputs, cached)

    async def _chained(self, req: GenerateRequest) -> AsyncIterator[bytes]:
        """Prefill on the named workers, then decode here (decode_worker/chain.py); every
        candidate failed: prefill here. A request fault of the prefill worker raises, so
        the router hears it as this call's status."""
        reply = await self._prefill_abortable(req)
        if reply is None:
            return await self._run(replace(req, prefill=None))
        ids = [reply.first_token_id]
        if reply.finish_reason is not None or reply.kv_handle is None:
            usage = Usage(len(req.prompt_token_ids), 1, reply.num_cached_tokens)
            line = encode_line(
                ids,
                reply.text,
                reply.finish_reason or "stop",
                usage,
                reply.logprobs,
                reply.prompt_logprobs,
            )
            self.metrics.requests.labels(self.ROLE, reply.finish_reason or "stop").inc()
            return _one(line)
        head = encode_line(ids, reply.text, None, None, reply.logprobs, reply.prompt_logprobs)
        return self._after_head(head, PrefillChain.after(req, reply), reply.num_cached_tokens)

    async def _prefill_abortable(self, req: GenerateRequest) -> PrefillReply | None:
        """The chain's prefill, which an abort of the request ends (``abort_chain``): the
        router gave up on this call (a hung prefill worker, the client gone) and may send
        the request again under the same id, here; the old call must not go on."""
        task = asyncio.current_task()
        assert task is not None
        self.abort_chain(req.request_id)  # an older call of this id still waiting
        self._chaining[req.request_id] = task
        try:
            return await self.chain.prefill(req)
        finally:
            if self._chaining.get(req.request_id) is task:
                del self._chaining[req.request_id]

    def abort_chain(self, request_id: str) -> bool:
        task = self._chaining.pop(request_id, None)
        if task is None:
            return False
        task.cancel()
        return True

    async def _after_head(
        self, head: bytes, req: GenerateRequest, cached: int
    ) -> AsyncIterator[bytes]:
        """The first token's line at once, then the decode of ``req``: an error that would
        have been this call's status is now a line (the stream has begun)."""
        yield head
        try:
            lines = await self._run(req, cached)
        except (BadRequest, InvalidParameter) as exc:  # this request alone: not retried
            yield _error_line(str(exc), "invalid_request_error", REQUEST_FAILED)
            return
        except Exception as exc:  # the worker's fault: the router moves on
            yield _error_line(f"{type(exc).__name__}: {exc}", "server_error", "engine_error")
            return
        async for line in lines:
            yield line

    async def _lines(
        self, first: RequestOutput, rest: AsyncIterator[RequestOutput], cached: int | None = None
    ) -> AsyncIterator[bytes]:
        out: RequestOutput | None = first
        while out is not None:
            yield self._line(out, cached)
            if out.finished:
                self.metrics.requests.labels(self.ROLE, out.finish_reason).inc()
                return
            out = await anext(rest, None)

    @staticmethod
    def _line(out: RequestOutput, cached: int | None = None) -> bytes:
        """``cached``: the prefill worker's cached prompt tokens (a chained request), in
        place of this worker's count (it computed none of the prompt)."""
        if out.finish_reason == "error":
            # request_failed: this request alone failed (the router does not retry it)
            request_fault = out.error_code == REQUEST_FAILED
            kind = "invalid_request_error" if request_fault else "server_error"
            error = WorkerError(out.error, kind, None, out.error_code or "kv_transfer_failed")
            return encode(TokenDelta(error=error)) + b"\n"
        usage = Usage(**out.usage) if out.finished else None
        if usage is not None and cached is not None:
            usage = replace(usage, cached_tokens=cached)
        return encode_line(
            out.token_ids, out.text, out.finish_reason, usage, out.logprobs, out.prompt_logprobs
        )

    def app(self) -> FastAPI:
        # The stream goes out through the direct lane (worker/direct.py): one send per
        # line, nothing between it and the server.
        secrets = keys.secrets_from_env() if env.service_secret("the decode worker") else ()
        app = DirectApp(secrets, known_error, title="pdserve decode worker")
        add_common_routes(app, self.engine, self.metrics, self.identity(), self.abort_chain)
        add_lora_routes(app, self.engine)

        async def generate(request: Request) -> Response:
            lines = await self.generate(await read_message(request, GenerateRequest))
            return LineStream(lines, media_type="application/x-ndjson")

        app.add_direct("POST", "/generate", generate)
        return app


async def _one(line: bytes) -> AsyncIterator[bytes]:
    yield line


def _error_line(message: str, kind: str, code: str) -> bytes:
    return encode(TokenDelta(error=WorkerError(message, kind, None, code))) + b"\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The decode worker's flags (worker/args.py)."""
    add_worker_arguments(parser, decode=True)
