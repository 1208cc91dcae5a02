"""Router -> worker calls are signed, never carry the secret (pdserve/signing.py).

On a real uvicorn server on loopback with the workers' SecretCheck, and the router's own
aiohttp session (pdserve/worker_calls/worker_client.py): a forged, altered, stale or replayed
call is refused; a reply without the worker's proof is not believed; and a rotation of the
secret (three rollouts, pods of old and new config side by side) never fails a call.
Before signatures, the router sent the secret itself in a header: the first tests here
fail then (a captured header replays; a fake worker learns the secret).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fastapi import FastAPI, Request

from pdserve import keys, signing
from pdserve.signed_httpx import SignedAuth
from pdserve.testing.router_fakes import serve
from pdserve.worker.http import SecretCheck
from pdserve.worker_calls.worker_client import UnprovenWorker, new_session

pytestmark = pytest.mark.unit

SECRET = "service-secret-1"


def worker(secrets: tuple[str, ...] = (SECRET,)) -> FastAPI:
    app = FastAPI()
    app.add_middleware(SecretCheck, secret=secrets)

    @app.post("/prefill")
    async def prefill(request: Request) -> dict[str, Any]:
        return {"got": (await request.body()).decode()}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    return app


def _ring(*secrets: str) -> keys.KeyRing:
    return keys.KeyRing(keys.HTTP, secrets)


async def test_router_session_signs_and_the_worker_proves() -> None:
    async with serve(worker()) as url, new_session(SECRET) as session:
        async with session.post(url + "/prefill", data=b"ids") as resp:
            assert resp.status == 200 and (await resp.json()) == {"got": "ids"}
            assert signing.HEADER not in resp.headers  # nothing secret comes back either
        async with session.get(url + "/health") as resp:  # the open probe proves it too
            assert resp.status == 200


async def test_forged_altered_stale_and_replayed_calls_are_refused() -> None:
    async with serve(worker()) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        host = url.split("://", 1)[1]  # the Host httpx sends: the worker the call names

        def signed(secret: str, body: bytes, now: float | None = None) -> dict[str, str]:
            auth = signing.sign(_ring(secret), "POST", "/prefill", body, now, host=host)
            return {signing.HEADER: auth}

        ok = signed(SECRET, b"ids")
        assert (await c.post("/prefill", content=b"ids", headers=ok)).status_code == 200
        cases = {
            "replayed": (ok, b"ids"),
            "another secret": (signed("guessed", b"ids"), b"ids"),
            "altered body": (signed(SECRET, b"ids"), b"other ids"),
            "stale": (signed(SECRET, b"ids", time.time() - 120), b"ids"),
            "from the future": (signed(SECRET, b"ids", time.time() + 120), b"ids"),
            "garbled": ({signing.HEADER: "v1 x y z"}, b"ids"),
            "the old bearer secret": ({"X-PDServe-Secret": SECRET}, b"ids"),
        }
        for case, (headers, body) in cases.items():
            resp = await c.post("/prefill", content=body, headers=headers)
            assert resp.status_code == 401, case
            assert resp.json()["error"]["code"] == "unauthorized", case
        # Signed for /stats is not signed for /prefill (the path is covered).
        other = {signing.HEADER: signing.sign(_ring(SECRET), "POST", "/stats", b"ids", host=host)}
        assert (await c.post("/prefill", content=b"ids", headers=other)).status_code == 401


async def test_a_reply_without_the_proof_is_not_believed() -> None:
    """A worker address from a poisoned discovery (or a pod that took its IP) answers
    200 without knowing the secret: the router's session raises, so the call fails over;
    and what that endpoint saw cannot be replayed to a real worker."""
    seen: list[str] = []
    hosts: list[str] = []

    async def impostor(request: web.Request) -> web.Response:
        seen.append(request.headers.get(signing.HEADER, ""))
        hosts.append(request.headers.get("Host", ""))
        return web.json_response({"tokens": "made up"})

    app = web.Application()
    app.router.add_post("/prefill", impostor)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with new_session(SECRET) as session:
            with pytest.raises(UnprovenWorker):
                async with session.post(str(server.make_url("/prefill")), data=b"ids"):
                    pass
    finally:
        await server.close()
    assert seen and SECRET not in seen[0]
    async with serve(worker()) as url, httpx.AsyncClient(base_url=url) as c:
        headers = {signing.HEADER: seen[0]}  # the captured call, sent on at once
        # It names the impostor (its Host is under the tag): refused as it is, and refused
        # with the impostor's Host forged in (the real worker's own address differs).
        assert (await c.post("/prefill", content=b"ids", headers=headers)).status_code == 401
        forged = {**headers, "Host": hosts[0]}
        assert (await c.post("/prefill", content=b"ids", headers=forged)).status_code == 401


async def test_a_call_replayed_to_another_worker_is_refused() -> None:
    """Issue 44 item 9: a call captured on its way to worker A, sent on to worker B of the
    same service within the 30 s window. Before, B served it (the tag named no worker)."""
    async with serve(worker()) as a_url, serve(worker()) as b_url:
        a_host, b_host = a_url.split("://")[1], b_url.split("://")[1]
        auth = signing.sign(_ring(SECRET), "POST", "/prefill", b"ids", host=a_host)
        async with httpx.AsyncClient(base_url=b_url, timeout=10) as b:
            for host in (None, a_host):  # B's own Host (the tag fails), A's (not B's address)
                headers = {signing.HEADER: auth, **({"Host": host} if host else {})}
                resp = await b.post("/prefill", content=b"ids", headers=headers)
                assert resp.status_code == 401, host
        async with httpx.AsyncClient(base_url=a_url, timeout=10) as a:
            ok = await a.post("/prefill", content=b"ids", headers={signing.HEADER: auth})
            assert ok.status_code == 200  # A, the worker it names, takes it
        # "localhost" names B too: a name is resolved and compared with B's address.
        b_port = b_host.rsplit(":", 1)[1]
        named = signing.sign(_ring(SECRET), "POST", "/prefill", b"ids", host=f"localhost:{b_port}")
        async with httpx.AsyncClient(base_url=f"http://localhost:{b_port}", timeout=10) as b:
            resp = await b.post("/prefill", content=b"ids", headers={signing.HEADER: named})
            assert resp.status_code == 200


async def test_rotation_without_a_failed_call() -> None:
    """Three rollouts: (old, +new accepted) -> (new, +old accepted) -> (new). During each,
    pods of the step before and the step after run side by side; every router config
    calls every worker config of the same moment, and every call succeeds."""
    old, new = "old-secret", "new-secret"
    steps = [(old,), (old, new), (new, old), (new,)]  # (signing, accepted...) per config
    for before, after in itertools.pairwise(steps):
        for router_cfg in (before, after):
            for worker_cfg in (before, after):
                async with (
                    serve(worker(worker_cfg)) as url,
                    new_session(router_cfg) as s,
                    s.post(url + "/prefill", data=b"x") as resp,
                ):
                    assert resp.status == 200, (router_cfg, worker_cfg)
    # And the pair that rotation must never produce does fail: a signer the worker
    # cannot check.
    async with serve(worker((old,))) as url, new_session((new,)) as s:
        with pytest.raises(aiohttp.ClientResponseError):
            async with s.post(url + "/prefill", data=b"x"):
                pass


def test_httpx_auth_signs_for_tools() -> None:
    """``pdserve up`` and the tests call workers with SignedAuth: the same signature."""
    verifier = signing.Verifier(_ring(SECRET))
    request = httpx.Request("POST", "http://w/prefill?x=1", content=b"ids")
    SignedAuth(SECRET)(request)
    auth = request.headers[signing.HEADER]
    verdict = verifier.check("POST", "/prefill?x=1", auth, b"ids", host="w")
    assert verdict.key is not None


def test_signing_cost_per_call() -> None:
    """The router's CPU per call: sign + check the proof (a few HMACs and a SHA-256 of
    the body); a generous bound so the test only catches an order-of-magnitude slip."""
    ring, body = _ring(SECRET), b"x" * 20_000  # about a 4k-token prompt's JSON
    n = 2000
    start = time.perf_counter()
    for _ in range(n):
        auth = signing.sign(ring, "POST", "/prefill", body)
        signing.proof_ok(ring, auth, signing.proof(ring.signing, auth))
    per_call_us = (time.perf_counter() - start) / n * 1e6
    assert per_call_us < 500, per_call_us


def test_mac_after_is_mac_over_head_and_parts() -> None:
    """The cached head (version, method, path; a proof's label) changes no tag: callers and
    workers on either side of an upgrade agree."""
    key = keys.derive("s3cret", keys.HTTP)
    parts = (b"1700000000.000", b"ab" * 12, hashlib.sha256(b"{}").digest())
    for head in (("v1", "POST", "/prefill"), ("reply",), ()):
        want = keys.mac(key, *(h.encode() for h in head), *parts)
        assert keys.mac_after(key, head, *parts) == want
        assert keys.mac_after(key, head, *parts) == want  # from the cache, the same
    assert keys.mac_after(b"", ("reply",), b"x") == b""


@pytest.mark.parametrize("key_len", [1, 32, 63, 64, 65, 200])
def test_tags_are_the_standard_hmac(key_len: int) -> None:
    """``keys.mac`` hashes the padded key blocks itself (``_Pads``): its tags are RFC 2104
    HMAC-SHA256, as ``hmac`` makes them, for keys shorter than, equal to and longer than
    SHA-256's block (hashed first), over an empty, short and long message; so are
    ``mac_after``'s, whose head is hashed once."""
    import hmac

    key = bytes(range(1, key_len + 1)) * 1
    for parts in ((), (b"",), (b"abc",), (b"x" * 5000, b"y")):
        framed = b"".join(len(p).to_bytes(8, "big") + p for p in parts)
        assert keys.mac(key, *parts) == hmac.new(key, framed, hashlib.sha256).digest()
        head = b"".join(len(p).to_bytes(8, "big") + p for p in (b"v1", b"POST", b"/prefill"))
        want = hmac.new(key, head + framed, hashlib.sha256).digest()
        assert keys.mac_after(key, ("v1", "POST", "/prefill"), *parts) == want
