"""Fake prefill and decode workers that follow docs/architecture.md's worker HTTP API.

They stand in for the real workers (prefill_worker/, decode_worker/) in the
router's API tests: they speak the same typed messages (``pdserve.protocol.contract``), stream
NDJSON, check the service secret (``SECRET``), publish real KV
events over ZeroMQ, hold "leases" and "KV blocks" as counters so every test can
check that everything is freed at the end, and fail on demand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.coalesce import CoalescingHttpTools
from pdserve.decode_worker.chain import PrefillChain
from pdserve.env import SERVICE_SECRET
from pdserve.protocol.codec import decode, encode, to_dict
from pdserve.protocol.contract import (
    AbortReply,
    GenerateRequest,
    KVHandle,
    PrefillReply,
    PrefillRequest,
    ReleaseReply,
    RequestRef,
    TokenDelta,
    Usage,
    WorkerError,
    WorkerStats,
)
from pdserve.protocol.hashing import block_hashes
from pdserve.protocol.kv_events import KVSnapshot
from pdserve.signed_httpx import SignedAuth
from pdserve.testing.loopback import free_port
from pdserve.worker.http import KEEP_ALIVE_S, BadRequest, SecretCheck
from pdserve.worker_calls import worker_client

# The suite's service secret (tests/conftest.py): the router under test reads it from the
# environment, as every real process does, and the fakes require it.
SECRET = os.environ[SERVICE_SECRET]
T = TypeVar("T")

BLOCK = 16
TOTAL_BLOCKS = 1000
MAX_MODEL_LEN = 2048


@dataclass
class FakeState:
    role: str
    worker_id: str
    # "" | "500" | "400" | "mid-stream" | "error-line" | "hang" | "request-fault" | "error-mid"
    # | "stall-mid" (hangs after 2 tokens and fails its health check, like a stopped worker)
    # | "stall-headers" (the same before the stream's headers) | "quiet-mid" (2 tokens,
    # then `quiet_s` of silence while healthy, then the rest) | "stall" (prefill: hangs and
    # fails its health check) | "mid-stream-once" (breaks once after 2 tokens, then works)
    fail: str = ""
    quiet_s: float = 0.0
    healthy: bool = True
    token_delay_s: float = 0.0
    end_delay_s: float = 0.0  # decode: after the last line, before the reply ends
    kv_events: str = ""
    leases: dict[str, int] = field(default_factory=dict)  # request_id -> blocks
    active: dict[str, int] = field(default_factory=dict)  # decode: request_id -> blocks
    requests: list[Any] = field(default_factory=list)  # PrefillRequest | GenerateRequest
    aborted: list[str] = field(default_factory=list)
    cached: set[int] = field(default_factory=set)
    seq: int = 0  # the last KV event's (a real worker's first event is 1)
    published: set[int] = field(default_factory=set)  # stored by the KV events sent
    # The throughput bench's long runs: keep no per-request record, and release leases
    # through one pooled client (a client per call cost the fake more than the router).
    keep_records: bool = True
    client: httpx.AsyncClient | None = None
    # The throughput bench: a prefill worker's state, in this process; a lease held there
    # ends on it directly (the signed /release call cost the fakes more than the router's
    # work), one held by another process's fake through that call.
    lease_holder: FakeState | None = None
    chain: Any = None  # decode: its PrefillChain, made on the first chained request
    chaining: dict[str, Any] = field(default_factory=dict)  # request id -> its prefill wait

    @property
    def kv_blocks_free(self) -> int:
        return TOTAL_BLOCKS - sum(self.leases.values()) - sum(self.active.values())


def _stats(st: FakeState) -> dict[str, Any]:
    return to_dict(
        WorkerStats(
            role=st.role,
            worker_id=st.worker_id,
            model="tiny",
            running=len(st.active),
            kv_blocks_free=st.kv_blocks_free,
            kv_blocks_total=TOTAL_BLOCKS,
            kv_events=st.kv_events,
            block_size=BLOCK,
            max_model_len=MAX_MODEL_LEN,
        )
    )


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return JSONResponse(body, status_code=status)


async def _receive(st: FakeState, request: Request, cls: type[T]) -> tuple[T, Any]:
    """The typed body, recorded; and the injected 500, if this worker is set to fail."""
    body = decode(await request.body(), cls)
    if st.keep_records:
        st.requests.append(body)
    return body, _error(500, "injected failure") if st.fail == "500" else None


def _common(app: FastAPI, st: FakeState) -> None:
    app.add_middleware(SecretCheck, secret=SECRET)  # signed calls, as real workers take

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"} if st.healthy else _error(503, "injected: unhealthy")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return _stats(st)

    @app.post("/abort")
    async def abort(request: Request) -> dict[str, Any]:
        rid = decode(await request.body(), RequestRef).request_id
        st.aborted.append(rid)
        found = st.leases.pop(rid, None) is not None or st.active.pop(rid, None) is not None
        waiting = st.chaining.pop(rid, None)  # a chained request's prefill call, as the real
        if waiting is not None:  # decode worker ends it (DecodeWorker.abort_chain)
            waiting.cancel()
            found = True
        return to_dict(AbortReply(found))


def stored_event(st: FakeState, hashes: list[int]) -> bytes:
    """The next KV event of ``st``'s stream: ``hashes`` stored (seq and snapshot kept)."""
    st.seq += 1
    st.published.update(hashes)
    ev = {
        "type": "kv_event",
        "kind": "stored",
        "worker_id": st.worker_id,
        "seq": st.seq,
        "block_hashes": hashes,
    }
    return json.dumps(ev).encode()


def prefill_app(st: FakeState, pub: zmq.asyncio.Socket | None = None) -> FastAPI:
    app = FastAPI()
    _common(app, st)
    # KV events go out as a real prefill worker's do (worker/core/events.py): the events
    # of one engine step in one message. Here a step is a loop turn: every request
    # prefilled in it (at least one; a real step holds as many as it batched).
    step: list[bytes] = []
    out: zmq.Socket[bytes] | None = zmq.Socket.shadow(pub.underlying) if pub is not None else None

    def publish() -> None:
        frames = [b"kv", *step]
        step.clear()
        assert out is not None
        out.send_multipart(frames)  # a PUB socket never blocks (it drops at its high mark)

    @app.get("/kv_blocks")
    async def kv_blocks() -> dict[str, Any]:  # as a real worker's (prefill_worker/events_api.py)
        return to_dict(KVSnapshot(st.worker_id, st.seq, sorted(st.published)))

    @app.post("/release")
    async def release(request: Request) -> dict[str, Any]:
        rid = decode(await request.body(), RequestRef).request_id
        return to_dict(ReleaseReply(st.leases.pop(rid, None) is not None))

    @app.post("/prefill")
    async def prefill(request: Request) -> Any:
        body, failed = await _receive(st, request, PrefillRequest)
        if failed is not None:
            return failed
        if st.fail == "400":
            return _error(400, "injected refusal")
        if st.fail == "request-fault":  # the request alone failed (worker_http, code 422)
            return _error(422, "request failed: injected", "request_failed")
        ids, rid = body.prompt_token_ids, body.request_id
        before = len(st.aborted)  # aborts of this rid before now are of an earlier prefill
        if st.fail == "stall":
            st.healthy = False
        while st.fail in ("hang", "stall") and rid not in st.aborted[before:]:  # until aborted
            await asyncio.sleep(0.02)
        if rid in st.aborted[before:]:  # like a real worker: an aborted prefill keeps no blocks
            return _error(400, "aborted")
        hashes = block_hashes(ids, BLOCK)
        cached = next((i for i, h in enumerate(hashes) if h not in st.cached), len(hashes))
        st.cached.update(hashes)
        if pub is not None:
            if not step:
                asyncio.get_running_loop().call_soon(publish)
            step.append(stored_event(st, hashes))
        first = 100 + sum(ids) % 50
        done = body.sampling.max_tokens == 1
        handle = None
        if not done:
            nblocks = -(-len(ids) // BLOCK)
            st.leases[rid] = nblocks
            handle = KVHandle(
                request_id=rid,
                agent_name=st.worker_id,
                side_channel="tcp://" + str(request.base_url).split("://")[1],
                block_ids=list(range(nblocks)),
                num_tokens=len(ids),
                block_hashes=hashes,
                block_size=BLOCK,
                nonce=uuid.uuid4().hex,
                lease_ttl_s=30,
                transport="tcp",
            )
        return to_dict(
            PrefillReply(
                rid,
                first,
                f"<{first}>",
                "length" if done else None,
                handle,
                cached * BLOCK,
                len(ids),
            )
        )

    return app


def decode_app(st: FakeState) -> FastAPI:
    app = FastAPI()
    _common(app, st)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body, failed = await _receive(st, request, GenerateRequest)
        if failed is not None:
            return failed
        rid, handle = body.request_id, body.kv_handle
        head = b""  # a chained request (--pd-handoff decode): the prefill's first token
        if body.prefill:
            st.chaining[rid] = asyncio.current_task()
            try:
                reply = await _chain(st).prefill(body)
            except BadRequest as exc:  # the prefill worker's request fault, as the real one
                return _error(exc.status, str(exc), exc.code)
            finally:
                st.chaining.pop(rid, None)
            if reply is not None:
                done = reply.finish_reason is not None or reply.kv_handle is None
                usage = Usage(len(body.prompt_token_ids), 1, reply.num_cached_tokens)
                head = (
                    encode(
                        TokenDelta(
                            [reply.first_token_id],
                            reply.text,
                            reply.finish_reason or "stop" if done else None,
                            usage if done else None,
                        )
                    )
                    + b"\n"
                )
                if done:
                    return StreamingResponse(iter([head]), media_type="application/x-ndjson")
                handle = reply.kv_handle
        resume = body.resume_token_ids or []  # a migrated stream: go on from there
        from_prefill = bool(handle) or any(t < 200 for t in resume)  # "<first>" ids are < 200
        n = body.sampling.max_tokens - (1 if from_prefill else 0)
        start = sum(1 for t in resume if t >= 200)
        st.active[rid] = -(-len(body.prompt_token_ids) // BLOCK)
        if st.fail == "stall-headers":
            await _hang(st, rid)
        held = st.lease_holder.leases if st.lease_holder is not None else {}
        if handle and handle.request_id in held:  # the bench's: a lease held in this process
            held.pop(handle.request_id)
        elif handle:  # "read" the blocks, then end the prefill worker's lease
            url = "http://" + handle.side_channel.removeprefix("tcp://").rstrip("/")
            await _release(st, url + "/release", encode(RequestRef(handle.request_id)))
        return StreamingResponse(
            _stream(st, rid, n, start, head), media_type="application/x-ndjson"
        )

    return app


def _chain(st: FakeState) -> PrefillChain:
    """The real decode worker's prefill calls (decode_worker/chain.py), signed with SECRET."""
    if st.chain is None:
        st.chain = PrefillChain(30.0, worker_client.new_pool(SECRET))
    return st.chain


async def _release(st: FakeState, url: str, content: bytes) -> None:
    if st.client is not None:
        await st.client.post(url, content=content)
        return
    async with httpx.AsyncClient(auth=SignedAuth(SECRET)) as c:
        await c.post(url, content=content)


async def _stream(
    st: FakeState, rid: str, n: int, start: int = 0, head: bytes = b""
) -> AsyncIterator[bytes]:
    try:
        if head:
            yield head
        for i in range(start, n):
            if rid not in st.active:  # aborted
                return
            if st.fail == "error-line":
                yield encode(TokenDelta(error=WorkerError("injected"))) + b"\n"
                return
            if st.fail == "request-fault" or (st.fail == "error-mid" and i == start + 2):
                # "this request failed": the router must neither retry nor migrate it
                err = WorkerError("request failed: injected", code="request_failed")
                yield encode(TokenDelta(error=err)) + b"\n"
                return
            if st.fail in ("mid-stream", "mid-stream-once") and i == start + 2:
                if st.fail == "mid-stream-once":  # then it works again (a restart)
                    st.fail = ""
                raise RuntimeError("injected crash mid-stream")
            if st.fail == "stall-mid" and i == start + 2:
                await _hang(st, rid)
                return
            if st.fail == "quiet-mid" and i == start + 2:
                await asyncio.sleep(st.quiet_s)
            await asyncio.sleep(st.token_delay_s)
            last = i == n - 1
            usage = Usage(0, n, 7) if last else None
            line = TokenDelta([200 + i], f" t{i}", "length" if last else None, usage)
            yield encode(line) + b"\n"
        if st.end_delay_s:  # else the end leaves with the last line, as the real worker's
            await asyncio.sleep(st.end_delay_s)  # (worker/direct.py, one write per turn)
    finally:
        st.active.pop(rid, None)


async def _hang(st: FakeState, rid: str) -> None:
    """Send nothing more and fail the health check, until the router's abort arrives."""
    st.healthy = False
    while rid in st.active:
        await asyncio.sleep(0.02)


class Servers:
    """uvicorn servers on 127.0.0.1 inside the test's event loop, stopped together.

    One stop waits out uvicorn's 0.1 s tick and the 0.1 s pause of its shutdown (~0.15-0.25 s
    here): four fakes stopped one after another cost ~0.65 s of each router test's teardown,
    stopped at once ~0.2 s."""

    def __init__(self) -> None:
        self._running: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(self, app: Any, port: int = 0, **kw: Any) -> str:
        """Serve an ASGI app on ``port`` (0: a free one); ``kw``: more of uvicorn.Config (the
        router's ``http`` protocol). Idle connections live as long as in a real worker
        (uvicorn's 5 s closed the router's pooled ones under it between two bench phases: a
        failed call and a worker out of rotation)."""
        port = port or free_port()
        kw.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
        config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", **kw
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        self._running.append((server, task))
        while not server.started:
            assert not task.done(), "server failed to start"
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        running, self._running = self._running, []
        for server, _ in running:
            server.should_exit = True
        await asyncio.wait_for(asyncio.gather(*(task for _, task in running)), 10)


@contextlib.asynccontextmanager
async def serve(app: Any, port: int = 0, **kw: Any) -> AsyncIterator[str]:
    """One app served (:meth:`Servers.start`) until the block ends."""
    servers = Servers()
    try:
        yield await servers.start(app, port, **kw)
    finally:
        await servers.stop()


@dataclass
class Fakes:
    """Fake prefill and decode workers on loopback (:func:`start_fakes`)."""

    prefill: list[FakeState]
    decode: list[FakeState]
    prefill_urls: list[str]
    decode_urls: list[str]


WORKER_HTTP = CoalescingHttpTools  # the real workers' server protocol (worker/http.py)


async def start_fakes(
    stack: contextlib.AsyncExitStack,
    n_prefill: int,
    n_decode: int,
    events: bool = True,
    busy: Sequence[int] = (),
) -> Fakes:
    """``n_prefill`` + ``n_decode`` fake workers, served until ``stack`` closes: each prefill
    fake publishes its KV events when ``events``; the ``busy`` decode fakes report one
    running request."""
    ctx = zmq.asyncio.Context()
    stack.callback(ctx.term)  # last: after the servers and their sockets
    fakes = Fakes([], [], [], [])
    pubs: list[Any] = []
    for i in range(n_prefill):
        st = FakeState("prefill", f"p{i}")
        pub = None
        if events:
            pub = ctx.socket(zmq.PUB)
            st.kv_events = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
            stack.callback(pub.close, 0)
        fakes.prefill.append(st)
        pubs.append(pub)
    for i in range(n_decode):
        st = FakeState("decode", f"d{i}")
        if i in busy:
            st.active["busy"] = 1
        fakes.decode.append(st)
    servers = Servers()
    stack.push_async_callback(servers.stop)  # every server at once, before the sockets close
    for st, pub in zip(fakes.prefill, pubs, strict=True):
        fakes.prefill_urls.append(await servers.start(prefill_app(st, pub), http=WORKER_HTTP))
    for st in fakes.decode:
        fakes.decode_urls.append(await servers.start(decode_app(st), http=WORKER_HTTP))
    return fakes
