"""The client's side of one response: a watch on its disconnect, and the SSE stream.

``guarded`` awaits one step of a request (admission, the first token) unless the client
goes away first; ``SSEStream`` writes a stream's events straight to the ASGI channel, and
``_WriteWatch`` aborts a stream whose client stopped reading. One ``_ClientWatch`` per
request serves both (router/api/serving.py uses them).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from pdserve.coalesce import ConnectionLoss
from pdserve.router.api import openai_response

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    pass


async def _wait_disconnect_asgi(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _ClientWatch:
    """One request's watch on its client, from the first ``guarded`` wait to the end of its
    stream: on the connection's loss it cancels whatever the request's own task awaits
    under the watch (``target``: admission, the first token, the stream's body). The
    router's own protocol tells of the loss by a callback (``ConnectionLoss``,
    pdserve/coalesce.py); under any other server a task awaits the ASGI disconnect.
    Before, each wait ran its work in a task of its own beside a task of its own watching
    the client: four tasks and two ``asyncio.wait`` per streamed request."""

    __slots__ = ("cancelled", "closed", "gone", "owner", "target", "task")
    KEY = "pdserve.client_watch"  # where the request's ASGI scope keeps it

    def __init__(self, receive: Any, loss: ConnectionLoss | None = None) -> None:
        self.gone = False  # the client went away (or its channel failed)
        self.target: asyncio.Task[Any] | None = None  # cancelled when the client goes
        self.cancelled = False  # this watch cancelled its target
        self.closed = False
        self.task: asyncio.Task[None] | None = None
        # The request's own task (the server's, for this request): every ``guarded`` wait
        # and the stream's pump run in it, so it is looked up once, here (each lookup
        # was a Python call in 3.11, ~1% of the router's CPU per request for the three).
        owner = asyncio.current_task()
        assert owner is not None
        self.owner: asyncio.Task[Any] = owner
        if loss is not None:  # the router's own protocol tells of the loss: no task
            if loss.lost:
                self.gone = True
            else:
                loss.callbacks.append(self._lost)
            return
        self.task = asyncio.get_running_loop().create_task(_wait_disconnect_asgi(receive))
        self.task.add_done_callback(self._fired)

    @classmethod
    def of(cls, scope: MutableMapping[str, Any], receive: Any) -> _ClientWatch:
        watch: _ClientWatch | None = scope.get(cls.KEY)
        if watch is None:
            watch = scope[cls.KEY] = cls(receive, scope.get(ConnectionLoss.KEY))
        return watch

    def _fired(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        self._lost()

    def _lost(self) -> None:
        if self.closed:
            return
        self.gone = True
        self.stop()

    def stop(self) -> None:
        """Cancel the target once (it waits under the watch: the cancel lands there)."""
        target, self.target = self.target, None
        if target is not None:
            self.cancelled = True
            target.cancel()

    def ours(self, task: asyncio.Task[Any]) -> bool:
        """A CancelledError in ``task`` under the watch: whether it was this watch's alone
        (then it is taken back); False: someone else cancelled the task too."""
        if not self.cancelled:
            return False
        self.cancelled = False
        return task.uncancel() == 0

    def close(self) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()


async def guarded(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw`` unless the client disconnects first (then cancel it, raise ClientGone)."""
    watch = _ClientWatch.of(request.scope, request.receive)
    if watch.gone:
        close = getattr(aw, "close", None)
        if close is not None:
            close()  # never started
        raise ClientGone
    task = watch.owner  # guarded runs in the request's task (router/api/serving.py)
    watch.target = task
    try:
        return await aw
    except asyncio.CancelledError:
        if watch.ours(task):
            raise ClientGone from None
        raise
    finally:
        watch.target = None


_HEADERS = [
    (k, v)
    for k, v in Response(media_type="text/event-stream").raw_headers
    if k != b"content-length"
]


class SSEStream(Response):
    """Server-sent events written straight to the ASGI channel; ``cleanup`` always runs.

    Leaner than Starlette's StreamingResponse (no anyio task group per response, see
    docs/router.md): the head goes out at once, then the body is pumped by the
    response's own task, cancelled (``_ClientWatch``) when the client goes away, or when
    one write has waited ``write_timeout`` seconds for a client that stopped reading
    (uvicorn's send waits while
    the socket's buffers are full; ``_WriteWatch`` looks): the stream is then aborted like
    a disconnect, so the worker frees its KV and nothing of this stream waits on that
    client any more.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        head: str,
        body: AsyncIterator[str],
        cleanup: Callable[[], Awaitable[None]],
        write_timeout: float = 30.0,
        on_slow_reader: Callable[[], None] = lambda: None,
    ) -> None:
        # Response.__init__'s work, done once (_HEADERS): no body, so no content-length.
        self.status_code, self.background, self.body = 200, None, b""
        self.raw_headers = list(_HEADERS)
        self._head = head  # the chunks ready now (the first token): sent before any task starts
        self._body = body
        self._cleanup = cleanup
        self._write_timeout = write_timeout
        self._on_slow_reader = on_slow_reader
        self._writing_since = 0.0  # loop time the pending write began; 0.0: none pending
        self._watch: _ClientWatch | None = None  # the client's (cancels the pump)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watch = self._watch = _ClientWatch.of(scope, receive)
        task = watch.owner  # the response is sent from the request's task
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            await send(
                {"type": "http.response.body", "body": self._head.encode(), "more_body": True}
            )
            if not watch.gone:
                _write_watch().add(self)
                watch.target = task  # the client going, or reading nothing, cancels the pump
                await self._pump(send)
        except asyncio.CancelledError:
            if not watch.ours(task):
                raise
        except OSError:  # the client went away while a chunk was written
            pass
        finally:
            watch.target = None
            _write_watch().discard(self)
            watch.close()
            await self._cleanup()

    async def _pump(self, send: Any) -> None:
        loop = asyncio.get_running_loop()
        body = aiter(self._body)
        async for text in body:
            # [DONE] ends an SSE stream: it goes out with the end of the body (one write
            # less per stream).
            last = text.endswith(openai_response.DONE)
            self._writing_since = loop.time()
            await send({"type": "http.response.body", "body": text.encode(), "more_body": not last})
            self._writing_since = 0.0
            if last:
                if self._watch is not None:
                    self._watch.target = None  # the client may go now: nothing is cut
                async for _ in body:  # sse_tail reads its worker's reply to the end
                    pass
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _too_slow(self, waited: float) -> None:
        log.warning(
            "stream aborted: its client read nothing for %.1f s (--stream-write-timeout)", waited
        )
        self._on_slow_reader()
        if self._watch is not None:
            self._watch.stop()  # the pump waits in a write: the cancel lands there


class _WriteWatch:
    """Every open stream's pending write on one event loop, looked at by one task every
    quarter of the shortest ``write_timeout`` among them: a stream whose write has waited
    its ``write_timeout`` is aborted (a task and a timer per stream did this before)."""

    def __init__(self) -> None:
        self.streams: dict[SSEStream, None] = {}
        self.task: asyncio.Task[None] | None = None
        self.period = 0.0

    def add(self, stream: SSEStream) -> None:
        self.streams[stream] = None
        if self.task is None or self.task.done() or stream._write_timeout / 4 < self.period:
            if self.task is not None:
                self.task.cancel()
            self.task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, stream: SSEStream) -> None:
        self.streams.pop(stream, None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.streams:
            self.period = min(s._write_timeout for s in self.streams) / 4
            await asyncio.sleep(self.period)
            now = loop.time()
            for stream in list(self.streams):
                since = stream._writing_since
                if since and now - since >= stream._write_timeout:
                    self.streams.pop(stream, None)
                    stream._too_slow(now - since)
        self.period, self.task = 0.0, None


_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _WriteWatch] = (
    weakref.WeakKeyDictionary()
)
_LAST: list[Any] = [None, None]  # the last loop asked for and its watch: one loop serves


def _write_watch() -> _WriteWatch:
    loop = asyncio.get_running_loop()
    if _LAST[0] is loop:  # a WeakKeyDictionary lookup was ~1% of the router's CPU
        return _LAST[1]  # type: ignore[no-any-return]
    watch = _WATCHES.get(loop)
    if watch is None:
        watch = _WATCHES[loop] = _WriteWatch()
    _LAST[0], _LAST[1] = loop, watch
    return watch
