"""Router replicas' budget owners in this process (router/peer_budgets.py), each behind a
real HTTP server on loopback: the signed calls, the proofs and an owner that stops
answering are the real ones; only the rest of the router is left out (the chaos bench,
bench/chaos_isolation.py; tests/router/test_peer_budgets.py runs whole routers)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from pdserve import keys
from pdserve.router.peer_budgets import PATH, PeerBudgets
from pdserve.router.ratelimit import RateLimiter
from pdserve.testing.loopback import free_port
from pdserve.testing.router_fakes import serve


@dataclass
class Replica:
    budgets: PeerBudgets
    url: str
    stack: contextlib.AsyncExitStack

    async def stop(self) -> None:
        """The replica goes away (its server stops answering)."""
        await self.stack.aclose()


class _App(FastAPI):
    """The router's lane for the budget calls (router/app.py): bare ASGI."""

    budgets: PeerBudgets

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") == PATH:
            await self.budgets.asgi(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def _app(budgets: PeerBudgets) -> FastAPI:
    app = _App()
    app.budgets = budgets
    return app


@contextlib.asynccontextmanager
async def replicas(
    n: int, cap: int = 0, rpm: int = 0, tpm: int = 0, secret: str = "peers"
) -> AsyncIterator[list[Replica]]:
    """``n`` replicas' budgets, each knowing all ``n`` as its peers."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(n)]
    ring = keys.KeyRing(keys.ROUTER_PEER, secret)
    out: list[Replica] = []
    try:
        for url in urls:
            budgets = PeerBudgets(url, urls, RateLimiter(rpm, tpm), cap, ring)
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(serve(_app(budgets), int(url.rsplit(":", 1)[1])))
            stack.push_async_callback(budgets.close)
            out.append(Replica(budgets, url, stack))
        for r in out:  # every replica has asked the others for its keys' counts
            assert await r.budgets.settled(5.0), r.budgets.pending
        yield out
    finally:
        for r in out:
            await r.stop()
