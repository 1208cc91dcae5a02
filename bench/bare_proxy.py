"""A bare HTTP proxy to one decode worker's ``/generate``: the floor for the router's overhead.

Same stack as the router (uvicorn with uvloop and httptools, aiohttp to the worker) and
nothing else: no parsing, no routing, no SSE; bytes are relayed as they arrive.
``bench/routing.py`` measures TTFT through it next to the router and straight to the
worker, so the router's own cost shows apart from the cost of one more process hop.

    python bench/bare_proxy.py WORKER_URL PORT
"""

from __future__ import annotations

import sys
from typing import Any

import aiohttp
import uvicorn

from pdserve import keys, signing
from pdserve.worker_calls.worker_client import new_session


def make_app(target: str) -> Any:
    session: aiohttp.ClientSession | None = None
    ring = keys.KeyRing.from_env(keys.HTTP)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    session = new_session()  # signs for the worker, as the router does
                    await send({"type": "lifespan.startup.complete"})
                else:
                    if session is not None:
                        await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert session is not None and scope["type"] == "http"
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {"content-type": "application/json"}
        # A call is signed for the worker it names (its Host, pdserve/signing.py): the
        # proxy signs its own call to the worker, as the router does, and proves the
        # secret to its caller (the worker's own proof answers the proxy's call).
        auth = dict(scope["headers"]).get(signing.HEADER_KEY)
        async with session.post(target + scope["path"], data=body, headers=headers) as resp:
            out = [(b"content-type", b"application/x-ndjson")]
            if auth is not None and ring:
                out.append((signing.PROOF_KEY, signing.proof(ring.signing, auth.decode()).encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            async for data in resp.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


if __name__ == "__main__":
    uvicorn.run(make_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
