"""The workers' direct lane (worker/direct.py) on a real uvicorn server on loopback, without
a model: what FastAPI's stack did for the streaming route, it still does — the secret
(401), OpenAI error bodies for request errors, a 500 for anything else — and a stream
whose client goes away has its lines closed (the decode worker aborts there)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import Request
from fastapi.responses import Response

from pdserve.env import SECRET_HEADER
from pdserve.protocol.contract import GenerateRequest
from pdserve.protocol.outputs import RequestFailed
from pdserve.protocol.sampling_params import InvalidParameter
from pdserve.signed_httpx import SignedAuth
from pdserve.testing.router_fakes import serve
from pdserve.worker.direct import DirectApp, LineStream
from pdserve.worker.http import BadRequest, SecretCheck, known_error, read_message

pytestmark = pytest.mark.unit

SECRET = "s3cret"
OK = SignedAuth(SECRET)  # a signed call (pdserve/signing.py), as the router makes


def app(closed: list[str]) -> DirectApp:
    app = DirectApp(SECRET, known_error)
    app.add_middleware(SecretCheck, secret=SECRET)
    app.get("/stats")(lambda: {"ok": True})  # through the stack, as before

    async def lines(n: int, rid: str) -> AsyncIterator[bytes]:
        try:
            for i in range(n):
                yield b'{"i":%d}\n' % i
                await asyncio.sleep(0.01)
        finally:
            closed.append(rid)

    async def generate(request: Request) -> Response:
        req = await read_message(request, GenerateRequest)
        fault = {
            "failed": RequestFailed("no room"),
            "bad-param": InvalidParameter("seed", "bad"),
            "crash": RuntimeError("bug"),
        }.get(req.request_id)
        if fault is not None:
            raise fault
        if req.request_id == "big":
            raise BadRequest("too big", status=413)
        return LineStream(lines(len(req.prompt_token_ids), req.request_id), "application/x-ndjson")

    app.add_direct("POST", "/generate", generate)
    return app


def body(rid: str, n: int) -> dict[str, object]:
    return {"type": "generate_request", "request_id": rid, "prompt_token_ids": [1] * n}


async def test_lines_stream_and_errors_keep_their_answers() -> None:
    closed: list[str] = []
    async with serve(app(closed)) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        resp = await c.post("/generate", json=body("r", 3), auth=OK)
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "application/x-ndjson"
        assert resp.text == '{"i":0}\n{"i":1}\n{"i":2}\n' and closed == ["r"]
        for headers in ({}, {SECRET_HEADER: SECRET}):  # the bearer secret is no longer taken
            resp = await c.post("/generate", json=body("r", 1), headers=headers)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "unauthorized"
        assert (await c.get("/stats")).status_code == 401  # the stack's check, still
        assert (await c.get("/stats", auth=OK)).json() == {"ok": True}
        cases = [
            ({**body("r", 1), "prompt_token_ids": "x"}, 400, "prompt_token_ids"),
            (body("bad-param", 1), 400, "seed"),
            (body("failed", 1), 422, None),
            (body("big", 1), 413, None),
        ]
        for sent, status, param in cases:
            resp = await c.post("/generate", json=sent, auth=OK)
            assert resp.status_code == status and resp.json()["error"]["param"] == param
        resp = await c.post("/generate", json=body("crash", 1), auth=OK)
        assert resp.status_code == 500 and resp.text == "Internal Server Error"
        # Only POST takes the lane: a GET is the stack's 405, behind its secret check.
        assert (await c.get("/generate", auth=OK)).status_code == 405


async def test_a_client_that_goes_away_closes_the_lines() -> None:
    closed: list[str] = []
    async with serve(app(closed)) as url:
        async with (
            httpx.AsyncClient(base_url=url, timeout=10) as c,
            c.stream("POST", "/generate", json=body("long", 10_000), auth=OK) as resp,
        ):
            async for _ in resp.aiter_lines():
                break  # leave after the first line: the connection closes
        for _ in range(200):
            if closed:
                break
            await asyncio.sleep(0.01)
        assert closed == ["long"]


@pytest.mark.parametrize("secret", ["", SECRET])
async def test_no_secret_configured_means_open_as_before(secret: str) -> None:
    lane = DirectApp(secret, known_error)

    async def one(_: Request) -> Response:
        return LineStream(aiter_of([b"x\n"]), "application/x-ndjson")

    lane.add_direct("POST", "/one", one)
    async with serve(lane) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        status = (await c.post("/one")).status_code
        assert status == (401 if secret else 200)


async def aiter_of(items: list[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item
