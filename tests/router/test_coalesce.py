"""The router's server side sends what one loop turn wrote as one buffer (pdserve/coalesce.py):
the transport wrapper against a recording transport, then uvicorn serving with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from pdserve.coalesce import CoalescingHttpTools, _TurnWriter

pytestmark = pytest.mark.unit


class Recorder:
    """A transport that keeps each ``write`` it is given."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_one_turns_writes_leave_as_one_and_a_later_turns_on_their_own() -> None:
    rec = Recorder()
    w = _TurnWriter(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
    w.write(b"HTTP/1.1 200 OK\r\n\r\n")
    w.write(b"5\r\nhello\r\n")
    assert rec.writes == [] and w.get_write_buffer_size() == 29  # held for the turn
    await asyncio.sleep(0)
    assert rec.writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"]
    w.write(b"1\r\n!\r\n")
    await asyncio.sleep(0)
    assert rec.writes[1:] == [b"1\r\n!\r\n"] and w.get_write_buffer_size() == 0
    w.write(b"")  # nothing to send: no turn is taken for it
    await asyncio.sleep(0)
    assert len(rec.writes) == 2
    assert w.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest: the transport's


async def test_a_close_sends_what_was_written_first_and_an_abort_drops_it() -> None:
    rec = Recorder()
    w = _TurnWriter(rec, asyncio.get_running_loop())  # type: ignore[arg-type]
    w.write(b"0\r\n\r\n")
    w.close()  # as uvicorn closes a connection that is not kept alive, in the same turn
    assert rec.writes == [b"0\r\n\r\n"] and rec.closed
    await asyncio.sleep(0)  # the turn's flush finds nothing more to send
    assert rec.writes == [b"0\r\n\r\n"]
    rec2 = Recorder()
    w2 = _TurnWriter(rec2, asyncio.get_running_loop())  # type: ignore[arg-type]
    w2.write(b"partial")
    w2.abort()
    await asyncio.sleep(0)
    assert rec2.writes == [] and rec2.aborted
    rec3 = Recorder()
    w3 = _TurnWriter(rec3, asyncio.get_running_loop())  # type: ignore[arg-type]
    w3.write(b"late")
    rec3.closed = True  # the peer went away before the turn ended: nothing is written
    await asyncio.sleep(0)
    assert rec3.writes == []


async def _app(scope: dict, receive: Any, send: Any) -> None:
    """A streamed reply: a head and a first chunk at once, the second only once the client
    says it has read the first (``/gate``); anything else: a small JSON body."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/stream":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: one\n\n", "more_body": True})
        await GATE.wait()
        await send({"type": "http.response.body", "body": b"data: two\n\n", "more_body": False})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
        }
    )
    await send({"type": "http.response.body", "body": b"{}"})


GATE = asyncio.Event()


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[int]:
    config = uvicorn.Config(
        _app,
        host="127.0.0.1",
        port=0,
        http=CoalescingHttpTools,
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def _read_until(reader: asyncio.StreamReader, marker: bytes, got: bytes = b"") -> bytes:
    while marker not in got:
        chunk = await asyncio.wait_for(reader.read(65536), timeout=5)
        assert chunk, got
        got += chunk
    return got


async def test_uvicorn_with_it_streams_each_chunk_when_written_and_keeps_alive() -> None:
    """The first chunk reaches the client while the second is not written yet (nothing is
    held past its turn: the server waits for the client's word before the second), the
    stream ends with the chunked terminator, and the same connection serves another."""
    GATE.clear()
    async with serving() as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            first = await _read_until(reader, b"data: one")
            assert (
                first.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in first
            )
            assert b"data: two" not in first
            GATE.set()
            rest = await _read_until(reader, b"0\r\n\r\n")
            assert b"data: two\n\n" in rest
            writer.write(b"GET /json HTTP/1.1\r\nhost: x\r\n\r\n")  # keep-alive: same socket
            again = await _read_until(reader, b"{}")
            assert again.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 2" in again
        finally:
            writer.close()


def test_the_workers_serve_with_it_as_the_fakes_do() -> None:
    """The real workers' server (worker/http.py) sends a loop turn's writes together, as
    the router's does, and the fakes the router's tests and benchmark run against use the
    same protocol: what the router reads from them is what it reads from real workers."""
    from fastapi import FastAPI

    from pdserve.testing.router_fakes import WORKER_HTTP
    from pdserve.worker.http import server

    assert server(FastAPI(), "127.0.0.1", 0, "warning").config.http is CoalescingHttpTools
    assert WORKER_HTTP is CoalescingHttpTools
