"""The floor under the router's CPU per request: what the HTTP stack alone costs.

``bench/router_throughput.py --floor`` drives these with the same client as the router:

* ``front PORT bare``: a bare ASGI app on the router's server set-up (uvicorn, uvloop,
  httptools, ``CoalescingHttpTools``) that reads the body and streams a completion's
  two SSE chunks, as the router's reply to a 4-token request comes out;
* ``front PORT calls WORKER_URL``: the same, after the P/D path's two worker calls made
  with the router's own pool (``pdserve/worker_calls/http1.py``, unsigned): a POST /prefill
  whose reply is read whole, and a POST /generate whose NDJSON body is read as it comes;
* ``worker PORT``: the worker side of those calls, canned replies of the fakes' size.

* ``front PORT lean WORKER_URL``: ``calls`` doing pdserve's own per-request pieces in one
  flat coroutine: the body parsed and checked (``parse_request``, the sampling
  parameters' ``validate``), the block hashes, both pools ranked with the shipped scorers
  (``plan_route`` over a fixed snapshot), both worker messages encoded with the codec and
  signed, the proofs checked, the reply and the stream's lines decoded, the SSE chunks
  formatted. No admission, failover, stall watch, metrics or client watch: an upper
  bound on what a leaner request path could save.

* ``front PORT lean-stream WORKER_URL``: ``lean`` written as the router writes: the
  decode worker sends its three tokens as three lines, each in its own write (as the
  tests' fake decode worker does), and each is relayed to the client as it arrives, the
  end (``[DONE]``) with the last: the same client writes per stream as the router makes,
  so the router's figure minus this one is its structure alone.

The router's figure minus ``calls`` is what pdserve's own work costs per request (parse,
checks, routing, the messages, signing, metrics, the stream's bookkeeping); minus
``lean``, what its layering costs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import uvicorn

from pdserve import keys
from pdserve.coalesce import CoalescingHttpTools
from pdserve.protocol.contract import CONTRACT_VERSION
from pdserve.worker_calls.http1 import WorkerPool

CHUNK = (
    b'data: {"id":"cmpl-0","object":"text_completion","created":1,"model":"tiny",'
    b'"choices":[{"index":0,"text":"<1>","logprobs":null,"finish_reason":null}]}\n\n'
)
PREFILL_REPLY = (
    b'{"request_id":"r","first_token_id":1,"text":"<1>","finish_reason":null,"kv_handle":'
    b'{"request_id":"r","agent_name":"p0","side_channel":"tcp://127.0.0.1:1","block_ids":'
    b'[0,1,2,3],"num_tokens":64,"block_hashes":[1,2,3,4],"block_size":16,"nonce":"n",'
    b'"lease_ttl_s":30.0,"transport":"tcp","version":%d,"lora":null,"type":"kv_handle"},'
    b'"num_cached_tokens":0,"prompt_tokens":64,"usage":null,"logprobs":null,'
    b'"prompt_logprobs":null,"type":"prefill_reply"}' % CONTRACT_VERSION
)
TOKEN_LINES = (  # /generate3: the same three tokens, a line (and a write) each
    b'{"token_ids":[2],"text":"<2>","finish_reason":null,"usage":null,"error":null,'
    b'"logprobs":null,"prompt_logprobs":null,"type":"token_delta"}\n',
    b'{"token_ids":[3],"text":"<3>","finish_reason":null,"usage":null,"error":null,'
    b'"logprobs":null,"prompt_logprobs":null,"type":"token_delta"}\n',
    b'{"token_ids":[4],"text":"<4>","finish_reason":"length","usage":'
    b'{"prompt_tokens":64,"completion_tokens":4,"cached_tokens":0,"type":"usage"},'
    b'"error":null,"logprobs":null,"prompt_logprobs":null,"type":"token_delta"}\n',
)
TOKEN_LINE = (
    b'{"token_ids":[2,3,4],"text":"<2><3><4>","finish_reason":"length","usage":'
    b'{"prompt_tokens":64,"completion_tokens":4,"cached_tokens":0,"type":"usage"},'
    b'"error":null,"logprobs":null,"prompt_logprobs":null,"type":"token_delta"}\n'
)


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        else:
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _body(receive: Any) -> bytes:
    parts = []
    while True:
        msg = await receive()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(parts)


def _lean() -> Any:
    """``lean`` mode's request handler (imports the router's pieces once)."""
    import os
    import random

    from pdserve import signing
    from pdserve.jsonguard import loads_checked
    from pdserve.protocol.codec import encode
    from pdserve.protocol.contract import GenerateRequest, PrefillRequest, WorkerStats
    from pdserve.protocol.hashing import block_hashes
    from pdserve.protocol.prefill_reply import decode_prefill_reply
    from pdserve.protocol.token_lines import decode_line
    from pdserve.router.api import openai_response
    from pdserve.router.api.openai_request import parse_request
    from pdserve.router.config import RouterConfig
    from pdserve.router.scheduling.route_request import RouteRequest
    from pdserve.router.scheduling.routing import plan_route
    from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

    ring = keys.KeyRing(keys.HTTP, "floor")
    cfg = RouterConfig(model_dir="tiny", disagg_threshold=0)
    stats = WorkerStats(kv_blocks_free=1000, kv_blocks_total=1000, block_size=16)
    rng = random.Random(0)

    async def handle(body: bytes, pool: WorkerPool, url: str, send: Any = None) -> tuple[str, str]:
        """The reply's head and rest; with ``send`` (lean-stream), written as they come."""
        req = parse_request(loads_checked(body), False, 16)
        req.sampling.validate(49152)
        ids = list(req.prompt_token_ids or ())
        rid = "cmpl-" + os.urandom(16).hex()
        snap = Snapshot(
            (WorkerView(url, "prefill", stats=stats), WorkerView(url, "decode", stats=stats))
        )
        hashes = block_hashes(ids, snap.block_size)
        route = RouteRequest(len(ids), tuple(hashes), snap.block_size, {}, {})
        plan_route(snap, route, cfg, rng)
        msg = encode(PrefillRequest(rid, ids, req.sampling))
        proof = signing.proof(ring.signing, signing.sign(ring, "POST", "/prefill", msg))
        async with await pool.post(url, "/prefill", msg, 30.0) as r:
            reply = decode_prefill_reply(await r.read())
        signing.proof_ok(ring, signing.sign(ring, "POST", "/x", b""), proof)
        chunks = openai_response.TextChunks(rid, "tiny", False)
        head = chunks(reply.text, None)
        if send is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": head.encode(), "more_body": True})
        msg = encode(GenerateRequest(rid, ids, req.sampling, reply.kv_handle, 1))
        proof = signing.proof(ring.signing, signing.sign(ring, "POST", "/generate", msg))
        rest, done = [], False
        path = "/generate3" if send is not None else "/generate"
        async with await pool.post(url, path, msg, 30.0) as r:
            while data := await r.readany():
                out = []
                for line in data.split(b"\n"):
                    if line:
                        d = decode_line(line)
                        out.append(chunks(d.text, d.finish_reason))
                        done = done or d.finish_reason is not None
                if send is None:
                    rest += out
                    continue
                text = "".join(out) + (openai_response.DONE if done else "")
                await send(
                    {"type": "http.response.body", "body": text.encode(), "more_body": not done}
                )
        signing.proof_ok(ring, signing.sign(ring, "POST", "/x", b""), proof)
        return head, "".join(rest) + openai_response.DONE

    return handle


def front(mode: str, worker_url: str = "") -> Any:
    pool: list[WorkerPool] = []
    lean = _lean() if mode in ("lean", "lean-stream") else None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        body = await _body(receive)
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        if lean is not None:
            if not pool:
                pool.append(WorkerPool(keys.KeyRing(keys.HTTP, ())))
            if mode == "lean-stream":  # written as it comes, as the router writes
                await lean(body, pool[0], worker_url, send)
                return
            head, rest = await lean(body, pool[0], worker_url)
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": head.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": rest.encode()})
            return
        if mode == "calls":
            if not pool:
                pool.append(WorkerPool(keys.KeyRing(keys.HTTP, ())))
            async with await pool[0].post(worker_url, "/prefill", body, 30.0) as r:
                await r.read()
            async with await pool[0].post(worker_url, "/generate", body, 30.0) as r:
                while await r.readany():
                    pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": CHUNK + b"data: [DONE]\n\n"})

    return app


async def worker(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        return await _lifespan(receive, send)
    await _body(receive)
    if scope["path"] == "/prefill":
        head = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": PREFILL_REPLY})
        return
    head = [(b"content-type", b"application/x-ndjson")]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    if scope["path"] == "/generate3":  # a line per send, as the fakes' decode worker writes
        for line in TOKEN_LINES:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.body", "body": TOKEN_LINE})


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description="The floor apps of bench/router_throughput.py --floor (module docstring)."
    )
    parser.add_argument("role", choices=["front", "worker"])
    parser.add_argument("port", type=int)
    parser.add_argument("mode", nargs="?", choices=["bare", "calls", "lean", "lean-stream"])
    parser.add_argument("worker_url", nargs="?", default="")
    args = parser.parse_args(argv)
    if args.role == "worker":
        app, http = worker, "auto"
    elif args.mode is None:
        parser.error("front needs a mode: bare, calls, lean or lean-stream")
    else:
        app, http = front(args.mode, args.worker_url), CoalescingHttpTools
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http=http,
    )  # type: ignore[arg-type]


if __name__ == "__main__":
    main(sys.argv[1:])
