"""The router's hot calls to its workers (prefill, generate, abort): a small keep-alive
HTTP/1.1 client on asyncio protocols, responses parsed by httptools.

aiohttp's client cost the router about a fifth of its CPU per request (its request and
response objects, header multidicts, middlewares, a timer rescheduled per chunk read;
docs/router.md "Throughput"). A worker call needs none of it: one POST of a JSON body,
a status, two headers and a body read as it comes. Health checks, KV snapshots and LoRA
calls stay on aiohttp (``worker_client.new_session``): they are not per request.

Each call is signed, and its reply counts only from a worker that proves the service
secret (pdserve/signing.py), as the aiohttp middleware does. The read timeout is per read
(no bytes for ``timeout`` seconds fail the call), kept by one timer per call that is
re-armed only when it fires, never per chunk. A connection goes back to the pool only
after its response was read to the end; anything else (an error, a cancellation, a body
left unread) closes it.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

import httptools

from pdserve import keys, signing

# (pool key, host, port, Host header, TLS context or None, path prefix) of a worker URL
_Target = tuple[Any, str, int, bytes, "ssl.SSLContext | None", str]


class CallFailed(Exception):
    """The worker did not answer usefully: connection refused or lost, a timeout, a
    malformed reply, or a reply without the proof of the service secret."""


class _Conn(asyncio.Protocol):
    """One connection; one response at a time (HTTP/1.1, no pipelining)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.chunks: collections.deque[bytes] = collections.deque()
        self.head_done = self.done = self.lost = self.keep_alive = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.last_data = 0.0  # loop time of the last bytes (the read timeout counts from it)
        self.idle_since = 0.0  # loop time it went back to the pool

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(CallFailed(f"malformed reply: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.done:
            self._fail(CallFailed(f"connection lost: {exc!r}" if exc else "connection closed"))

    # -- httptools callbacks ------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it after this
        self._wake()

    # -- the caller's side --------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def start(self, data: bytes) -> None:
        """Send one request. The parser goes on from the last response: only a connection
        whose response was read to its end comes back from the pool (``release``), and
        llhttp starts on the next message by itself (a parser per call cost ~2% of the
        router's CPU on the P/D path)."""
        self.status, self.headers = 0, {}
        self.head_done = self.done = self.keep_alive = False
        self.last_data = self.loop.time()
        assert self.transport is not None
        self.transport.write(data)

    async def wait(self) -> None:
        if self.error is not None:
            raise self.error
        w = self.waiter = self.loop.create_future()
        await w

    def reusable(self, now: float, keepalive_s: float) -> bool:
        return (
            not self.lost
            and self.error is None
            and self.transport is not None
            and not self.transport.is_closing()
            and now - self.idle_since < keepalive_s
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Response:
    """A worker's reply: ``status``, ``header(name)``, and its body (``read`` whole or
    ``readany`` as it comes); use as ``async with`` so the connection goes back to the
    pool, or is closed when the body was not read to its end."""

    __slots__ = ("_conn", "_key", "_pool", "_timeout", "_timer", "status")

    def __init__(self, pool: WorkerPool, key: Any, conn: _Conn, timeout: float) -> None:
        self._pool, self._key, self._conn, self._timeout = pool, key, conn, timeout
        self._timer: asyncio.TimerHandle | None = None
        self.status = 0

    def _arm(self) -> None:
        conn = self._conn
        self._timer = conn.loop.call_at(conn.last_data + self._timeout, self._check)

    def _check(self) -> None:
        """The read timeout's timer: fails the call after ``timeout`` s without bytes while
        it waits; otherwise sleeps again until ``timeout`` after the last bytes."""
        conn = self._conn
        if conn.loop.time() - conn.last_data >= self._timeout and conn.waiter is not None:
            self._timer = None
            conn._fail(CallFailed(f"no bytes from the worker for {self._timeout:g} s"))
        else:
            self._arm()

    async def _head(self) -> None:
        conn = self._conn
        while not conn.head_done:
            await conn.wait()
        self.status = conn.status

    def header(self, name: bytes) -> str | None:
        value = self._conn.headers.get(name)
        return value.decode("latin-1") if value is not None else None

    async def readany(self) -> bytes:
        """The bytes that arrived since the last read (waiting for some); b"" at the end."""
        conn = self._conn
        while True:
            chunks = conn.chunks
            if chunks:
                if len(chunks) == 1:
                    return chunks.popleft()
                data = b"".join(chunks)
                chunks.clear()
                return data
            if conn.done:
                return b""
            await conn.wait()

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        clean = conn.done and not conn.chunks and conn.error is None and not conn.lost
        if clean and conn.keep_alive:
            self._pool._put(self._key, conn)
        else:
            conn.close()


class WorkerPool:
    """Keep-alive connections to the workers, one pool per worker address, unbounded;
    ``ring``: the service secret's keys (empty: calls unsigned, replies unchecked)."""

    def __init__(self, ring: keys.KeyRing, keepalive_s: float = 60.0) -> None:
        self.ring, self.keepalive_s = ring, keepalive_s
        self._idle: dict[Any, list[_Conn]] = {}
        self._targets: dict[str, _Target] = {}
        self._closed = False

    def _target(self, url: str) -> _Target:
        t = self._targets.get(url)
        if t is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            host = parts.hostname or ""
            port = parts.port or (443 if tls else 80)
            ctx = ssl.create_default_context() if tls else None
            t = self._targets[url] = (
                (host, port, tls),
                host,
                port,
                parts.netloc.encode(),
                ctx,
                parts.path.rstrip("/"),
            )
        return t

    async def post(self, url: str, path: str, body: bytes, timeout: float) -> Response:
        """POST ``body`` (JSON) to ``url + path``; the reply once its head is in (status
        and headers, the worker's proof checked). Raises :class:`CallFailed`."""
        key, host, port, netloc, ctx, prefix = self._target(url)
        path = prefix + path
        conn = await self._get(key, host, port, ctx, timeout)
        head = [
            b"POST ",
            path.encode(),
            b" HTTP/1.1\r\nHost: ",
            netloc,
            b"\r\nContent-Type: application/json\r\nContent-Length: ",
            str(len(body)).encode(),
        ]
        auth = ""
        if self.ring:
            auth = signing.sign(self.ring, "POST", path, body, host=netloc.decode())
            head += [b"\r\nX-PDServe-Auth: ", auth.encode()]
        head += [b"\r\n\r\n", body]
        resp = Response(self, key, conn, timeout)
        try:
            conn.start(b"".join(head))
            resp._arm()
            await resp._head()
        except BaseException:
            resp.release()
            raise
        if self.ring and not signing.proof_ok(self.ring, auth, resp.header(signing.PROOF_KEY)):
            resp.release()
            raise CallFailed("the worker did not prove the service secret")
        return resp

    async def _get(
        self, key: Any, host: str, port: int, ctx: ssl.SSLContext | None, timeout: float
    ) -> _Conn:
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if conn.reusable(now, self.keepalive_s):
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(min(timeout, 10.0)):
                _, conn = await loop.create_connection(lambda: _Conn(loop), host, port, ssl=ctx)
        except (OSError, TimeoutError) as exc:
            raise CallFailed(f"cannot connect to {host}:{port}: {exc!r}") from exc
        return conn

    def _put(self, key: Any, conn: _Conn) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
