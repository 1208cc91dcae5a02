"""The router's hop to a decode worker's NDJSON stream, against a real aiohttp server on
loopback that writes its lines in chosen bursts, pausing between them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.protocol.codec import to_dict
from pdserve.protocol.contract import GenerateRequest, TokenDelta, WorkerError
from pdserve.worker_calls.worker_client import (
    MAX_LINE_BYTES,
    WorkerFailed,
    generate,
    merge_lines,
    new_pool,
)

pytestmark = pytest.mark.unit


def tok(i: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta([i], f" t{i}", finish)


def test_merge_lines_joins_token_runs_and_stops_at_finish_and_errors() -> None:
    err = TokenDelta(error=WorkerError("boom"))
    merged = merge_lines([tok(0), tok(1), tok(2, "length"), tok(3)])
    assert merged == [TokenDelta([0, 1, 2], " t0 t1 t2", "length"), tok(3)]
    assert merge_lines([tok(0), err, tok(1)]) == [tok(0), err, tok(1)]
    assert merge_lines([]) == []


async def serve_bursts(bursts: list[bytes], pause_s: float = 0.2) -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, burst in enumerate(bursts):
            if i:
                await asyncio.sleep(pause_s)  # the reader drains each burst before the next
            await resp.write(burst)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/generate", handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def collect(
    bursts: list[bytes], pause_s: float = 0.2, timeout: float = 10.0
) -> list[TokenDelta]:
    gen = serve_bursts(bursts, pause_s)
    url = await anext(gen)
    try:
        pool = new_pool("")  # the burst server is no worker: unsigned
        try:
            req = GenerateRequest("r", [1])
            return [m async for m in generate(pool, url, req, timeout=timeout)]
        finally:
            await pool.close()
    finally:
        await gen.aclose()


def lines(*msgs: TokenDelta) -> bytes:
    return b"".join(json.dumps(to_dict(m)).encode() + b"\n" for m in msgs)


async def test_lines_split_across_reads_and_a_last_line_without_newline() -> None:
    raw = lines(tok(0), tok(1)) + json.dumps(to_dict(tok(2, "stop"))).encode()
    got = await collect([raw[:5], raw[5:40], raw[40:]])  # cuts inside lines
    assert "".join(m.text for m in got) == " t0 t1 t2"
    assert [i for m in got for i in m.token_ids] == [0, 1, 2]
    assert got[-1].finish_reason == "stop"


async def test_a_burst_of_lines_becomes_one_message() -> None:
    got = await collect([lines(tok(0)), lines(tok(1), tok(2), tok(3, "length"))])
    assert got[0] == tok(0)
    assert got[1] == TokenDelta([1, 2, 3], " t1 t2 t3", "length")


@pytest.mark.parametrize(
    ("bursts", "match"),
    [
        ([b"{not json}\n"], "bad stream line"),
        ([b"[1, 2]\n"], "bad stream line"),
        ([b'{"type": "token_delta", "token_ids": 5}\n'], "bad stream line"),
        ([b'{"token_ids": [5]}\n'], "bad stream line"),  # not a typed message
        ([b"x" * (MAX_LINE_BYTES + 10)], "stream line over"),
    ],
)
async def test_broken_streams_fail_the_worker(bursts: list[bytes], match: str) -> None:
    with pytest.raises(WorkerFailed, match=match):
        await collect(bursts)


async def test_the_timeout_is_per_read_not_for_the_whole_stream() -> None:
    bursts = [lines(tok(i)) for i in range(5)] + [lines(tok(5, "length"))]
    got = await collect(bursts, pause_s=0.2, timeout=0.6)  # 1 s in all, never 0.6 s idle
    assert [i for m in got for i in m.token_ids] == list(range(6))
    with pytest.raises(WorkerFailed, match="generate failed"):
        await collect([lines(tok(0)), lines(tok(1, "length"))], pause_s=1.5, timeout=0.5)


def test_each_server_keeps_idle_connections_longer_than_its_clients() -> None:
    """A server that closes an idle connection first races its client reusing it: the
    request fails (tests/local/test_scale_under_load.py checks the processes)."""
    from pdserve.router.main import CLIENT_KEEP_ALIVE_S
    from pdserve.worker.http import KEEP_ALIVE_S
    from pdserve.worker_calls.worker_client import POOL_KEEPALIVE_S

    assert KEEP_ALIVE_S > POOL_KEEPALIVE_S + 30  # workers outlast the router's pool
    # the router outlasts httpx (5 s, the OpenAI SDK), aiohttp (15 s), Go (90 s) pools
    assert CLIENT_KEEP_ALIVE_S > 90
