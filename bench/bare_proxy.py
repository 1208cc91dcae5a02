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

from pdserve.signing import HEADER, HEADER_KEY, PROOF_HEADER


def make_app(target: str) -> Any:
    session: aiohttp.ClientSession | None = None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
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
        # The caller's signature passes on unchanged (same method, path and body), as a
        # signing router's own call would carry it (pdserve/signing.py).
        auth = dict(scope["headers"]).get(HEADER_KEY)
        if auth is not None:
            headers[HEADER] = auth.decode()
        async with session.post(target + scope["path"], data=body, headers=headers) as resp:
            out = [(b"content-type", b"application/x-ndjson")]
            if PROOF_HEADER in resp.headers:  # the worker's proof goes back to the caller
                out.append((PROOF_HEADER.lower().encode(), resp.headers[PROOF_HEADER].encode()))
            await send({"type": "http.response.start", "status": resp.status, "headers": out})
            async for data in resp.content.iter_any():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


if __name__ == "__main__":
    uvicorn.run(make_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
