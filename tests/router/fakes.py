"""Fake prefill and decode workers that follow docs/architecture.md's worker HTTP API.

They stand in for the real workers (prefill_worker/, decode_worker/) in the
router's API tests: they speak the same JSON, stream NDJSON, publish real KV
events over ZeroMQ, hold "leases" and "KV blocks" as counters so every test can
check that everything is freed at the end, and fail on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.codec import to_dict
from pdserve.engine.hashing import block_hashes
from pdserve.transfer.messages import KVHandle
from tests.loopback import free_port

BLOCK = 16
TOTAL_BLOCKS = 1000
MAX_MODEL_LEN = 2048


@dataclass
class FakeState:
    role: str
    worker_id: str
    # "" | "500" | "400" | "mid-stream" | "error-line" | "hang" | "request-fault" | "error-mid"
    fail: str = ""
    token_delay_s: float = 0.0
    kv_events: str = ""
    leases: dict[str, int] = field(default_factory=dict)  # request_id -> blocks
    active: dict[str, int] = field(default_factory=dict)  # decode: request_id -> blocks
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    cached: set[int] = field(default_factory=set)
    seq: int = 0

    @property
    def kv_blocks_free(self) -> int:
        return TOTAL_BLOCKS - sum(self.leases.values()) - sum(self.active.values())


def _stats(st: FakeState) -> dict[str, Any]:
    return {
        "role": st.role, "worker_id": st.worker_id, "model": "tiny", "running": len(st.active),
        "waiting": 0, "kv_blocks_free": st.kv_blocks_free, "kv_blocks_total": TOTAL_BLOCKS,
        "queued_prompt_tokens": 0, "prefix_cache_hit_tokens": 0, "kv_events": st.kv_events,
        "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN,
    }  # fmt: skip


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": code}}  # fmt: skip
    return JSONResponse(body, status_code=status)


def _common(app: FastAPI, st: FakeState) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return _stats(st)

    @app.post("/abort")
    async def abort(request: Request) -> dict[str, bool]:
        rid = (await request.json())["request_id"]
        st.aborted.append(rid)
        found = st.leases.pop(rid, None) is not None or st.active.pop(rid, None) is not None
        return {"aborted": found}


def prefill_app(st: FakeState, pub: zmq.asyncio.Socket | None = None) -> FastAPI:
    app = FastAPI()
    _common(app, st)

    @app.post("/release")
    async def release(request: Request) -> dict[str, bool]:
        return {"released": st.leases.pop((await request.json())["request_id"], None) is not None}

    @app.post("/prefill")
    async def prefill(request: Request) -> Any:
        body = await request.json()
        st.requests.append(body)
        if st.fail == "500":
            return _error(500, "injected failure")
        if st.fail == "400":
            return _error(400, "injected refusal")
        if st.fail == "request-fault":  # the request alone failed (worker_http, code 422)
            return _error(422, "request failed: injected", "request_failed")
        ids, rid = body["prompt_token_ids"], body["request_id"]
        while st.fail == "hang" and rid not in st.aborted:  # until the router aborts it
            await asyncio.sleep(0.02)
        if rid in st.aborted:  # like a real worker: an aborted prefill keeps no blocks
            return _error(400, "aborted")
        hashes = block_hashes(ids, BLOCK)
        cached = next((i for i, h in enumerate(hashes) if h not in st.cached), len(hashes))
        st.cached.update(hashes)
        if pub is not None:
            ev = {"type": "kv_event", "kind": "stored", "worker_id": st.worker_id,
                  "seq": st.seq, "block_hashes": hashes}  # fmt: skip
            st.seq += 1
            await pub.send_multipart([b"kv", json.dumps(ev).encode()])
        first = 100 + sum(ids) % 50
        done = body["sampling"]["max_tokens"] == 1
        handle = None
        if not done:
            nblocks = -(-len(ids) // BLOCK)
            st.leases[rid] = nblocks
            handle = to_dict(KVHandle(
                request_id=rid, agent_name=st.worker_id, side_channel=str(request.base_url),
                block_ids=list(range(nblocks)), num_tokens=len(ids), block_hashes=hashes,
                block_size=BLOCK, lease_expires_at=1e12, transport="tcp",
            ))  # fmt: skip
        return {"request_id": rid, "first_token_id": first, "text": f"<{first}>",
                "finish_reason": "length" if done else None, "kv_handle": handle,
                "num_cached_tokens": cached * BLOCK, "prompt_tokens": len(ids)}  # fmt: skip

    return app


def decode_app(st: FakeState) -> FastAPI:
    app = FastAPI()
    _common(app, st)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        st.requests.append(body)
        if st.fail == "500":
            return _error(500, "injected failure")
        rid, handle = body["request_id"], body.get("kv_handle")
        resume = body.get("resume_token_ids") or []  # a migrated stream: go on from there
        from_prefill = bool(handle) or any(t < 200 for t in resume)  # "<first>" ids are < 200
        n = body["sampling"]["max_tokens"] - (1 if from_prefill else 0)
        start = sum(1 for t in resume if t >= 200)
        st.active[rid] = -(-len(body["prompt_token_ids"]) // BLOCK)
        if handle:  # "read" the blocks, then release the prefill worker's lease
            async with httpx.AsyncClient() as c:
                await c.post(handle["side_channel"].rstrip("/") + "/release",
                             json={"request_id": handle["request_id"]})  # fmt: skip
        return StreamingResponse(_stream(st, rid, n, start), media_type="application/x-ndjson")

    return app


async def _stream(st: FakeState, rid: str, n: int, start: int = 0) -> AsyncIterator[bytes]:
    try:
        for i in range(start, n):
            if rid not in st.active:  # aborted
                return
            if st.fail == "error-line":
                yield json.dumps({"error": {"message": "injected"}}).encode() + b"\n"
                return
            if st.fail == "request-fault" or (st.fail == "error-mid" and i == start + 2):
                # "this request failed": the router must neither retry nor migrate it
                err = {"message": "request failed: injected", "code": "request_failed"}
                yield json.dumps({"error": err}).encode() + b"\n"
                return
            if st.fail == "mid-stream" and i == start + 2:
                raise RuntimeError("injected crash mid-stream")
            await asyncio.sleep(st.token_delay_s)
            last = i == n - 1
            line: dict[str, Any] = {"token_ids": [200 + i], "text": f" t{i}",
                                    "finish_reason": "length" if last else None}  # fmt: skip
            if last:
                line["usage"] = {"prompt_tokens": 0, "completion_tokens": n, "cached_tokens": 7}
            yield json.dumps(line).encode() + b"\n"
    finally:
        st.active.pop(rid, None)


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn on 127.0.0.1 inside the test's event loop."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "server failed to start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
