"""The prefill worker: computes prompts, returns the first token and a KV handle.

router ──POST /prefill──▶ engine (hold_kv) ──handoff──▶ KVServer: blocks under a lease
                                                          │
decode worker ◀── KV handle ◀── PrefillReply ◀────────────┘
decode worker ──claim, NIXL READ, done (side channel)──▶ lease ended, blocks freed
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.prefill_worker.events_api import add_event_routes
from pdserve.protocol.contract import PrefillReply, PrefillRequest, ReleaseReply, RequestRef, Usage
from pdserve.protocol.outputs import HANDOFF, REQUEST_FAILED, RequestOutput
from pdserve.worker.http import (
    BadRequest,
    add_common_routes,
    read_message,
    reply,
)
from pdserve.worker.lora_api import add_lora_routes
from pdserve.worker.role import RoleWorker


class PrefillWorker(RoleWorker):
    # The engine, the KV lease server and the KV event publisher run in a child
    # process (worker/core/prefill.py).
    ROLE = "prefill"

    def identity(self) -> dict[str, Any]:
        return {
            **super().identity(),
            "kv_events": self.engine.info["kv_events"],
            "side_channel": self.engine.info["side_channel"],
            "kv_transport": self.engine.info["kv_transport"],
        }

    async def prefill(self, req: PrefillRequest) -> PrefillReply:
        rid, prompt = req.request_id, req.prompt_token_ids
        final: RequestOutput | None = None
        salt = req.cache_salt
        async for out in self.engine.generate(
            rid, prompt, req.sampling, hold_kv=True, cache_salt=salt, lora=req.lora
        ):
            final = out
        assert final is not None and final.finished
        if final.queue_seconds is not None:
            self.metrics.queue_wait.labels(self.ROLE).observe(final.queue_seconds)
        self.metrics.requests.labels(self.ROLE, final.finish_reason).inc()
        if final.error_code == REQUEST_FAILED:  # this request alone: the router must not retry
            raise BadRequest(final.error, status=422, code=REQUEST_FAILED)
        if final.finish_reason in ("error", "abort"):
            raise BadRequest(final.error or f"request {final.finish_reason}", status=503)
        handle = final.kv_handle if final.finish_reason == HANDOFF else None
        return PrefillReply(
            request_id=rid,
            first_token_id=final.token_ids[0],
            text=final.text,
            finish_reason=None if handle is not None else final.finish_reason,
            kv_handle=handle,
            num_cached_tokens=final.num_cached_tokens,
            prompt_tokens=final.num_prompt_tokens,
            usage=Usage(**final.usage),
            logprobs=final.logprobs,  # the first token's, when the request asked
            prompt_logprobs=final.prompt_logprobs,
        )

    def app(self) -> FastAPI:
        app = FastAPI(title="pdserve prefill worker")
        add_common_routes(app, self.engine, self.metrics, self.identity())
        add_event_routes(app, self.engine)  # GET /kv_blocks
        add_lora_routes(app, self.engine)

        @app.post("/prefill")
        async def prefill(request: Request) -> JSONResponse:
            return reply(await self.prefill(await read_message(request, PrefillRequest)))

        @app.post("/release")
        async def release(request: Request) -> JSONResponse:
            """HTTP fallback of the side channel's done: end a lease now."""
            rid = (await read_message(request, RequestRef)).request_id
            return reply(ReleaseReply(bool(await self.engine.query("release", rid))))

        return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prefill worker's flags (worker/args.py)."""
    from pdserve.worker.http import add_worker_arguments

    add_worker_arguments(parser)
