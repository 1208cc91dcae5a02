"""uvicorn's httptools protocol with the writes of one event-loop turn sent together.

uvicorn writes a response's head the moment the app sends ``http.response.start``, and
each body chunk as it comes: for a streamed completion the head and the first token,
sent back to back, were two ``send`` calls. On loopback (and to a pod on the same node)
the kernel delivers each one inside the sender's call, so they cost the router about as
much as a token's write each (py-spy of the router on the P/D path: the head's write
alone was ~6% of its CPU). ``CoalescingHttpTools`` gives uvicorn a transport that keeps
what one turn of the loop wrote and sends it as one buffer at the end of the turn
(``loop.call_soon``): the head leaves with the first chunk, a token written later is
sent on its own turn as before, and nothing waits for more than the turn it was written
in. ``pdserve router`` serves with it (router/main.py), and so do the workers
(worker/http.py): a prefill reply's head and body reach the router in one segment.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# In a request's scope once its whole body is in: router/edge.py reads it without a wait.
BODY_COMPLETE = "pdserve.body_complete"


class _TurnWriter:
    """A connection's transport whose writes of one loop turn go out as one ``write``."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is pending (at the end of the turn, or before a close)."""
        if not self._pending:
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()  # what was written before the close still goes out, as it would have
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class ConnectionLoss:
    """A request's news of its connection going (``scope[ConnectionLoss.KEY]``): the
    callbacks registered run once when it goes; ``lost`` says whether it already has.
    The router's client watch (router/api/client_stream.py) registers here instead of
    running a task that awaits the ASGI disconnect (a task, its first step and its cancel
    per request, ~2% of the P/D path's CPU)."""

    __slots__ = ("callbacks", "lost")
    KEY = "pdserve.connection_loss"

    def __init__(self) -> None:
        self.lost = False
        self.callbacks: list[Any] = []

    def fire(self) -> None:
        if self.lost:
            return
        self.lost = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


class CoalescingHttpTools(HttpToolsProtocol):
    """``uvicorn.Config(http=CoalescingHttpTools)``: httptools, one send per loop turn, and
    each request told of its connection's loss (``ConnectionLoss``) when its response is
    not complete (as uvicorn's ``http.disconnect``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_TurnWriter(transport, self.loop))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        self.scope[ConnectionLoss.KEY] = ConnectionLoss()  # type: ignore[literal-required]
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.scope[BODY_COMPLETE] = True  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:  # its response was not complete
            loss = cycle.scope.get(ConnectionLoss.KEY)
            if isinstance(loss, ConnectionLoss):
                loss.fire()


def server_config(app: Any, log_level: str, keep_alive_s: int, **kw: Any) -> uvicorn.Config:
    """The uvicorn config the router (router/main.py) and a worker (worker/http.py) serve
    with: ``CoalescingHttpTools``, no access log, idle connections kept ``keep_alive_s``;
    ``kw``: the rest of ``uvicorn.Config`` (host, port, loop, ...)."""
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=keep_alive_s,
        http=CoalescingHttpTools,
        **kw,
    )
