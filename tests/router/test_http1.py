"""The router's keep-alive client for its per-request worker calls
(pdserve/worker_calls/http1.py), against raw asyncio servers that answer as told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from pdserve import keys, signing
from pdserve.worker_calls.http1 import CallFailed, WorkerPool

pytestmark = pytest.mark.unit

Reply = Callable[[bytes], bytes]  # the request's head and body -> the raw reply


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


class Server:
    def __init__(self, reply: Reply) -> None:
        self.reply, self.connections, self.requests = reply, 0, []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                req = await read_request(reader)
                self.requests.append(req)
                writer.write(self.reply(req))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Reply], asyncio.Future[tuple[str, Server]]]]:
    servers = []

    async def start(reply: Reply) -> tuple[str, Server]:
        srv = Server(reply)
        s = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        servers.append(s)
        return f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}", srv

    yield start  # type: ignore[misc]
    for s in servers:
        s.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra)) + body


async def test_calls_reuse_one_connection_when_each_reply_is_read(serve) -> None:
    url, srv = await serve(lambda req: ok(b'{"x":1}'))
    pool = WorkerPool(keys.KeyRing(keys.HTTP, ""))
    for _ in range(3):
        async with await pool.post(url, "/abort", b"{}", 5.0) as resp:
            assert resp.status == 200 and await resp.read() == b'{"x":1}'
    assert srv.connections == 1 and len(srv.requests) == 3
    # a reply left unread closes its connection: the next call opens another
    async with await pool.post(url, "/abort", b"{}", 5.0) as resp:
        assert resp.status == 200
    async with await pool.post(url, "/abort", b"{}", 5.0) as resp:
        await resp.read()
    assert srv.connections == 2
    await pool.close()


async def test_a_chunked_stream_is_read_as_it_comes(serve) -> None:
    chunks = [b"a\n", b"bb\n", b"ccc"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    url, _ = await serve(
        lambda req: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    )
    pool = WorkerPool(keys.KeyRing(keys.HTTP, ""))
    async with await pool.post(url, "/generate", b"{}", 5.0) as resp:
        assert await resp.read() == b"a\nbb\nccc"
    await pool.close()


async def test_calls_are_signed_and_a_reply_must_prove_the_secret(serve) -> None:
    ring = keys.KeyRing(keys.HTTP, "s3cret")
    verifier = signing.Verifier(ring)

    def proving(req: bytes) -> bytes:
        head, body = req.split(b"\r\n\r\n", 1)
        auth = next(
            line.split(b": ", 1)[1].decode()
            for line in head.split(b"\r\n")
            if line.lower().startswith(signing.HEADER_KEY)
        )
        host = next(line[6:].decode() for line in head.split(b"\r\n") if line.startswith(b"Host:"))
        assert verifier.check("POST", "/w/prefill", auth, body, host=host.strip()).key is not None
        return ok(
            b"{}",
            b"%s: %s\r\n"
            % (signing.PROOF_HEADER.encode(), signing.proof(ring.signing, auth).encode()),
        )

    url, _ = await serve(proving)
    pool = WorkerPool(ring)
    async with await pool.post(url + "/w", "/prefill", b'{"a":1}', 5.0) as resp:
        assert await resp.read() == b"{}"
    url, _ = await serve(lambda req: ok(b"{}"))  # no proof: not one of ours
    with pytest.raises(CallFailed, match="did not prove"):
        await pool.post(url, "/prefill", b"{}", 5.0)
    await pool.close()


async def test_a_reply_cut_short_fails_and_a_silent_worker_times_out(serve) -> None:
    url, _ = await serve(lambda req: b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc")
    pool = WorkerPool(keys.KeyRing(keys.HTTP, ""))
    # the server waits for the next request while 97 bytes are owed: the read times out
    async with await pool.post(url, "/generate", b"{}", 0.3) as resp:
        assert await resp.readany() == b"abc"
        with pytest.raises(CallFailed, match="no bytes"):
            await resp.readany()

    def close_after_head(req: bytes) -> bytes:
        raise ConnectionResetError  # the handler closes the connection without a reply

    url, _ = await serve(close_after_head)
    with pytest.raises(CallFailed, match="connection"):
        await pool.post(url, "/generate", b"{}", 5.0)
    with pytest.raises(CallFailed, match="cannot connect"):
        await pool.post("http://127.0.0.1:9", "/generate", b"{}", 5.0)  # discard: refused
    await pool.close()
