"""The prefill worker: computes prompts, returns the first token and a KV handle.

router ──POST /prefill──▶ engine (hold_kv) ──handoff──▶ blocks held under a lease
                                                          │
decode worker ◀── KV handle ◀── response ◀────────────────┘
decode worker ──NIXL READ──▶ pool; ──release (side channel)──▶ lease freed
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.codec import to_dict
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import engine_config_from_args
from pdserve.engine.llm_engine import HANDOFF
from pdserve.engine.request import REQUEST_FAILED, RequestOutput
from pdserve.prefill_worker.events import KVEventPublisher
from pdserve.prefill_worker.leases import LeaseManager
from pdserve.transfer.messages import CompatRecord
from pdserve.transfer.server import KVServer
from pdserve.worker_http import (
    BadRequest,
    add_common_routes,
    advertise_host,
    cache_salt_of,
    error_response,
    parse_request,
    read_json,
    worker_id,
)
from pdserve.worker_metrics import WorkerMetrics

logger = logging.getLogger(__name__)
ROLE = "prefill"


class PrefillWorker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker_id = worker_id(args, ROLE)
        host = advertise_host(args)
        self.engine = AsyncEngine(engine_config_from_args(args))
        e = self.engine.engine
        e.blocks.record_events = True
        self.metrics = WorkerMetrics(self.engine, ROLE)
        self.leases = LeaseManager(args.lease_seconds, self.metrics.lease_expired.labels(ROLE).inc)
        events_port = args.kv_events_port or args.port + 1
        self.events = KVEventPublisher(f"tcp://{args.host}:{events_port}", self.worker_id)
        self.events_address = f"tcp://{host}:{events_port}"
        self.kv = KVServer(
            e.pool.tensor,
            CompatRecord.for_pool(e.pool.tensor, e.model_id),
            transport=args.kv_transport,
            host=args.host,
            port=args.side_channel_port or args.port + 2,
            advertise_host=host,
            on_release=self.leases.release,
        )
        self.engine.hooks += [self.leases.hook, self.events.hook]

    def stats_extra(self) -> dict[str, Any]:
        return {
            "role": ROLE,
            "worker_id": self.worker_id,
            "kv_events": self.events_address,
            "side_channel": self.kv.side_channel,
            "kv_transport": self.kv.transport_name,
        }

    async def prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        rid, prompt, params = parse_request(body)
        final: RequestOutput | None = None
        salt = cache_salt_of(body)
        async for out in self.engine.generate(rid, prompt, params, hold_kv=True, cache_salt=salt):
            final = out
        assert final is not None and final.finished
        if final.queue_seconds is not None:
            self.metrics.queue_wait.labels(ROLE).observe(final.queue_seconds)
        self.metrics.requests.labels(ROLE, final.finish_reason).inc()
        if final.error_code == REQUEST_FAILED:  # this request alone: the router must not retry
            raise BadRequest(final.error, status=422, code=REQUEST_FAILED)
        if final.finish_reason in ("error", "abort"):
            raise BadRequest(final.error or f"request {final.finish_reason}", status=503)
        handle = None
        if final.finish_reason == HANDOFF:
            assert final.kv_block_ids is not None and final.kv_block_hashes is not None
            handle = self.kv.make_handle(
                rid,
                final.kv_block_ids,
                len(prompt),
                final.kv_block_hashes,
                self.args.lease_seconds,
            )
        return {
            "request_id": rid,
            "first_token_id": final.token_ids[0],
            "text": final.text,
            "finish_reason": None if handle is not None else final.finish_reason,
            "kv_handle": to_dict(handle) if handle is not None else None,
            "num_cached_tokens": final.num_cached_tokens,
            "prompt_tokens": final.num_prompt_tokens,
            "usage": final.usage,
            "logprobs": final.logprobs,  # the first token's, when the request asked
        }

    def app(self) -> FastAPI:
        app = FastAPI(title="pdserve prefill worker")
        add_common_routes(app, self.engine, self.metrics, self.stats_extra())

        @app.post("/prefill")
        async def prefill(request: Request) -> JSONResponse:
            return JSONResponse(await self.prefill(await read_json(request)))

        @app.post("/release")
        async def release(request: Request) -> JSONResponse:
            body = await read_json(request)
            rid = body.get("request_id")
            if not isinstance(rid, str):
                return error_response(400, "request_id must be a string", "request_id")
            held = await self.engine.call(lambda e: rid in e.held)
            self.leases.release(rid)
            return JSONResponse({"released": bool(held)})

        return app

    def close(self) -> None:
        self.engine.shutdown()
        self.kv.close()
        self.events.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pdserve.worker_http import add_worker_arguments

    add_worker_arguments(parser, default_port=8100)
    g = parser.add_argument_group("prefill")
    g.add_argument("--kv-events-port", type=int, default=None, help="default: port + 1")
    g.add_argument("--lease-seconds", type=float, default=30.0)
