"""A direct lane for a worker's streaming routes: past FastAPI's middleware and routing.

A streamed token is one ``send`` per line; through FastAPI each one also passes the
error middleware's and the exception middleware's ``send`` wrappers, and Starlette's
``StreamingResponse`` adds a task group. On the decode worker that was about a third of
its HTTP loop's CPU per token (``bench/stream_overhead.py``), taken from the same GIL
as the engine thread. The lane keeps what the stack gave these routes: the signed-call
check (401 as :class:`~pdserve.worker.http.SecretCheck` answers it), OpenAI error
bodies for the known request errors (the app's exception handlers), and a plain 500,
logged, for anything else (Starlette's ``ServerErrorMiddleware``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from pdserve import keys
from pdserve.signing import PROOF_KEY
from pdserve.worker.auth import CallCheck
from pdserve.worker.http import refusal

Handler = Callable[[Request], Awaitable[Response]]


class DirectApp(FastAPI):
    """FastAPI whose direct routes (:meth:`add_direct`: a handler returning a Response)
    skip the middleware stack; every other request goes through it as usual.

    ``errors`` turns an exception into its response (None: not a request error)."""

    def __init__(
        self,
        secret: str | tuple[str, ...],
        errors: Callable[[Exception], Response | None],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        ring = keys.KeyRing(keys.HTTP, secret)
        self.check = CallCheck(ring, refusal) if ring else None
        self.errors = errors
        self.direct: dict[tuple[str, str], Handler] = {}

    def add_direct(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``method path`` on the lane; the route is also the stack's, so that the
        other methods still get its 405 and the schema still lists it."""
        self.direct[method, path] = handler
        self.add_api_route(path, handler, methods=[method])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        handler = None
        if scope["type"] == "http":
            handler = self.direct.get((scope["method"], scope["path"]))
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        proof = None
        if self.check is not None:
            checked = await self.check(scope, receive, send)
            if checked is None:
                return
            receive, proof = checked
        try:
            response = await handler(Request(scope, receive))
        except Exception as exc:
            known = self.errors(exc)
            if known is None:  # what ServerErrorMiddleware does: a 500, then the server logs
                await PlainTextResponse("Internal Server Error", 500)(scope, receive, send)
                raise
            response = known
        if proof is not None:  # in the head itself: no wrapper around each line's send
            response.raw_headers.append((PROOF_KEY, proof))
        await response(scope, receive, send)


class LineStream(Response):
    """Lines (bytes) written straight to the ASGI channel as they come; the head goes out
    at once. The lines' iterator is closed when the stream ends or the client goes away
    (for the decode stream that aborts the request in the engine)."""

    def __init__(self, lines: AsyncIterator[bytes], media_type: str) -> None:
        super().__init__(media_type=media_type)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._lines = lines

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        pump = gone = None
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            pump = asyncio.create_task(self._pump(send))
            gone = asyncio.create_task(_wait_disconnect(receive))
            await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()  # a failure of the lines reaches the server, as before
        finally:
            for task in (pump, gone):
                if task is not None:
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                if pump is not None and not pump.done():
                    await pump
            aclose = getattr(self._lines, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _pump(self, send: Any) -> None:
        async for line in self._lines:
            await send({"type": "http.response.body", "body": line, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
