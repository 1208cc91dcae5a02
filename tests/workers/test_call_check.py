"""A worker checks ``X-PDServe-Auth``'s header before it reads a body, and reads a body
under a deadline (issue 44 item 9). Before: any caller made the worker read up to
64 MiB (and wait for it as long as the caller liked) before the 401. The ASGI channel
here counts what the check pulled from it: no sockets needed to see that."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve import keys, signing
from pdserve.worker.auth import CallCheck

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]
RING = keys.KeyRing(keys.HTTP, ("service-secret",))


def _scope(auth: str | None) -> dict[str, Any]:
    headers = [(signing.HEADER_KEY, auth.encode())] if auth is not None else []
    return {
        "type": "http",
        "method": "POST",
        "path": "/generate",
        "query_string": b"",
        "headers": headers,
    }


class Channel:
    """An ASGI receive of 1 MiB chunks (``delay_s`` apart), counting what was pulled."""

    def __init__(self, chunks: int = 8, delay_s: float = 0.0) -> None:
        self.left, self.delay_s, self.pulled = chunks, delay_s, 0

    async def receive(self) -> dict[str, Any]:
        await asyncio.sleep(self.delay_s)
        self.pulled += 1 << 20
        self.left -= 1
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": self.left > 0}


def _check() -> tuple[CallCheck, list[int]]:
    refused: list[int] = []

    def refuse(status: int, message: str) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            refused.append(status)

        return app

    return CallCheck(RING, refuse), refused


async def _noop(message: Any) -> None:
    pass


async def test_an_unsigned_call_is_refused_before_its_body_is_read() -> None:
    check, refused = _check()
    for auth in (None, "v1 garbage", signing.sign(RING, "POST", "/generate", now=1.0)):
        channel = Channel()
        assert await check(_scope(auth), channel.receive, _noop) is None
        assert channel.pulled == 0  # not one byte read
    assert refused == [401, 401, 401]
    body = b"x" * (8 << 20)  # a signed call is read and passes
    channel = Channel()
    auth = signing.sign(RING, "POST", "/generate", body)
    assert await check(_scope(auth), channel.receive, _noop) is not None
    assert channel.pulled == len(body)


async def test_a_trickled_body_is_a_408() -> None:
    check, refused = _check()
    check.body_timeout_s = 0.3
    auth = signing.sign(RING, "POST", "/generate", b"")
    channel = Channel(chunks=100, delay_s=0.05)
    assert await check(_scope(auth), channel.receive, _noop) is None
    assert refused == [408] and channel.pulled < 20 << 20
