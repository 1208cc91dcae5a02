"""router/proxy_headers.py: the scope comes out as uvicorn's ProxyHeadersMiddleware leaves
it, and the app's own coroutine is what the server awaits (no frame around it)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from pdserve.router.proxy_headers import FlatProxyHeaders

pytestmark = pytest.mark.unit

CASES = [
    # (client, headers)
    (("127.0.0.1", 5000), [(b"x-forwarded-for", b"10.1.2.3"), (b"x-forwarded-proto", b"https")]),
    (("127.0.0.1", 5000), [(b"x-forwarded-for", b"10.1.2.3, 127.0.0.1")]),
    (("127.0.0.1", 5000), [(b"x-forwarded-for", b"")]),
    (("127.0.0.1", 5000), [(b"x-forwarded-proto", b"gopher")]),
    (("10.9.9.9", 5000), [(b"x-forwarded-for", b"10.1.2.3")]),  # not trusted: unchanged
    (None, [(b"x-forwarded-for", b"10.1.2.3")]),
    (("127.0.0.1", 5000), [(b"x-forwarded-for", b"[::1]:80, 10.0.0.1:9")]),
]


def _scope(client: Any, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "scheme": "http", "client": client, "headers": headers}


@pytest.mark.parametrize("trusted", ["127.0.0.1", "*", "10.0.0.0/8", "192.168.0.1"])
@pytest.mark.parametrize(("client", "headers"), CASES)
def test_the_scope_is_rewritten_as_uvicorn_does(trusted: str, client: Any, headers: Any) -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> str:
        seen["scope"] = scope
        return "done"

    async def both() -> None:
        want = _scope(client, headers)
        await ProxyHeadersMiddleware(app, trusted)(want, None, None)  # type: ignore[arg-type]
        ours = FlatProxyHeaders(app, trusted)(copy.deepcopy(_scope(client, headers)), None, None)
        assert asyncio.iscoroutine(ours)  # the app's own coroutine, handed back
        assert await ours == "done"
        assert seen["scope"] == want

    asyncio.run(both())


def test_lifespan_goes_through() -> None:
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(scope["type"])

    asyncio.run(FlatProxyHeaders(app, "127.0.0.1")({"type": "lifespan"}, None, None))
    assert calls == ["lifespan"]
