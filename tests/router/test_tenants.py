"""Tenants at the router (issue 24): a slow client holds no admission slot, one key cannot
crowd out another (per-key cap, fair waiting queue, priority classes), admin endpoints
need an admin key, and API keys reload from their file. Fake workers; real sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from pdserve.router.admission import Admission
from pdserve.router.errors import APIError
from tests.router.raw_http import connect, read_reply

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def _trickler(url: str) -> socket.socket:
    """A connection that sends its head and one byte of a 1000-byte body, then waits."""
    return connect(
        url,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: 1000\r\n\r\n{",
    )


async def test_trickling_bodies_do_not_lock_out_other_clients(cluster_factory) -> None:
    """40 connections trickle their bodies on a router with 4 slots: another client's
    requests are all served (before the fix each trickler took a slot before its body
    was read: every other request got 429 queue_full), and the tricklers get a 408 once
    --body-timeout passes."""
    async with cluster_factory(max_queue=4, max_waiting=0, body_timeout_s=1.5) as c:
        socks = [await asyncio.to_thread(_trickler, c.url) for _ in range(40)]
        try:
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=c.url, timeout=10) as h:
                codes = [(await h.post("/v1/completions", json=OK)).status_code for _ in range(5)]
            assert codes == [200] * 5, codes
            assert c.runtime.active == 0  # the tricklers hold nothing
            t0 = time.monotonic()
            reply = await asyncio.to_thread(read_reply, socks[0])
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert b"body-timeout" in reply and time.monotonic() - t0 < 3
        finally:
            for s in socks:
                s.close()
        await c.settle()


async def test_concurrency_per_key_is_capped(cluster_factory) -> None:
    cfg = {"api_keys": ("ka", "kb"), "max_concurrency_per_key": 2, "disagg_threshold": 10_000}
    async with cluster_factory(**cfg) as c, httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        c.decode[0].token_delay_s = 0.1
        a, b = ({"Authorization": f"Bearer {k}"} for k in ("ka", "kb"))
        slow = {**OK, "max_tokens": 8}
        busy = [
            asyncio.create_task(h.post("/v1/completions", json=slow, headers=a)) for _ in range(2)
        ]
        while c.runtime.active < 2:
            await asyncio.sleep(0.01)
        r = await h.post("/v1/completions", json=OK, headers=a)
        assert r.status_code == 429, r.text
        assert "--max-concurrency-per-key" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert (await h.post("/v1/completions", json=OK, headers=b)).status_code == 200
        assert all(x.status_code == 200 for x in await asyncio.gather(*busy))
        await c.settle()


async def _spin() -> None:
    """Let woken tasks run (a grant passes a future, a shield and wait_for)."""
    for _ in range(10):
        await asyncio.sleep(0)


async def _release_as_granted(tasks: list[asyncio.Task[object]]) -> None:
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result().release()  # type: ignore[attr-defined]


async def _take(adm: Admission, client: str, priority: int = 0) -> object:
    return await adm.acquire(client, priority)


async def test_a_full_queue_is_shared_fairly_across_clients() -> None:
    """One slot, four places to wait. Client A fills all of them; B's one request then
    takes the place of A's newest waiter (A's gets the 429) and gets the next free slot
    ahead of A's older waiters, because A already holds one. Before (one shared counter,
    no queue) B got 429 queue_full."""
    adm = Admission(slots=1, max_waiting=4, wait_s=5)
    held = await adm.acquire("A")
    a_waiting = [asyncio.create_task(_take(adm, "A")) for _ in range(4)]
    await _spin()
    assert adm.num_waiting == 4
    b = asyncio.create_task(_take(adm, "B"))
    await _spin()
    refused = [t for t in a_waiting if t.done()]
    assert len(refused) == 1 and isinstance(refused[0].exception(), APIError)
    assert refused[0].exception().code == "queue_full"  # type: ignore[union-attr]
    held.release()  # type: ignore[attr-defined]
    await _spin()
    assert b.done() and adm.held == {"B": 1}  # B first: A held a slot, B none
    (await b).release()  # type: ignore[attr-defined]
    await _release_as_granted([t for t in a_waiting if t is not refused[0]])
    assert adm.active == 0 and adm.num_waiting == 0


async def test_one_client_cannot_push_out_another_with_as_many_waiters() -> None:
    adm = Admission(slots=1, max_waiting=2, wait_s=5)
    held = await adm.acquire("A")
    waiters = [asyncio.create_task(_take(adm, c)) for c in ("A", "B")]
    await _spin()
    with pytest.raises(APIError) as err:  # full; A and B have one waiter each: A is refused
        await adm.acquire("A")
    assert err.value.code == "queue_full"
    held.release()  # type: ignore[attr-defined]
    await _release_as_granted(waiters)
    assert adm.active == 0 and adm.num_waiting == 0


async def test_priority_classes_and_timeouts() -> None:
    adm = Admission(slots=1, max_waiting=8, wait_s=0.2)
    held = await adm.acquire("low")
    low = asyncio.create_task(_take(adm, "low2", 0))
    high = asyncio.create_task(_take(adm, "high", 5))
    await _spin()
    held.release()  # type: ignore[attr-defined]
    await _spin()
    assert high.done() and not low.done()  # the higher class goes first
    with pytest.raises(APIError) as err:  # no slot within --queue-timeout
        await low
    assert err.value.status == 429 and adm.num_waiting == 0
    (await high).release()  # type: ignore[attr-defined]
    # a waiter whose client goes away leaves no trace
    held = await adm.acquire("x")
    gone = asyncio.create_task(_take(adm, "y"))
    await _spin()
    gone.cancel()
    await _spin()
    held.release()  # type: ignore[attr-defined]
    assert adm.active == 0 and adm.num_waiting == 0 and adm.held == {}


async def test_admin_endpoints_need_an_admin_key(cluster_factory, tiny_model_dir) -> None:
    """With API keys on, a tenant key opens the API but not /metrics or /workers (403);
    the admin key opens them; /v1/models names the model, not its directory."""
    cfg = {"api_keys": ("tenant",), "admin_api_keys": ("boss",)}
    async with cluster_factory(**cfg) as c, httpx.AsyncClient(base_url=c.url) as h:
        tenant, boss = ({"Authorization": f"Bearer {k}"} for k in ("tenant", "boss"))
        for path in ("/metrics", "/workers"):
            r = await h.get(path, headers=tenant)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
            assert (await h.get(path)).status_code == 401
            assert (await h.get(path, headers=boss)).status_code == 200
        models = (await h.get("/v1/models", headers=tenant)).json()
        assert str(tiny_model_dir) not in str(models) and models["data"][0]["root"] == "tiny"
        assert (await h.post("/v1/completions", json=OK, headers=tenant)).status_code == 200
        assert (await h.get("/health")).status_code == 200  # probes need no key
        await c.settle()


async def test_api_keys_reload_from_their_file(cluster_factory, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenants\nold-key\n")
    async with cluster_factory(api_key_file=str(keys)) as c:
        async with httpx.AsyncClient(base_url=c.url) as h:
            old, new = ({"Authorization": f"Bearer {k}"} for k in ("old-key", "new-key"))
            assert (await h.post("/v1/completions", json=OK, headers=old)).status_code == 200
            assert (await h.post("/v1/completions", json=OK, headers=new)).status_code == 401
            keys.write_text("new-key priority=2\n")
            os.utime(keys, ns=(time.time_ns(), time.time_ns() + 10**9))
            await asyncio.sleep(1.1)  # the file is looked at most once a second
            assert (await h.post("/v1/completions", json=OK, headers=new)).status_code == 200
            assert (await h.post("/v1/completions", json=OK, headers=old)).status_code == 401
            assert c.runtime.keys.tenant_keys() == {"new-key": 2}
            keys.write_text("")  # an emptied file keeps the keys (a half-written Secret)
            os.utime(keys, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
            await asyncio.sleep(1.1)
            assert (await h.post("/v1/completions", json=OK, headers=new)).status_code == 200
        await c.settle()


def test_key_lines_and_open_router_warning(caplog: pytest.LogCaptureFixture) -> None:
    from pdserve.router.api_keys import parse_key_lines
    from pdserve.router.config import RouterConfig
    from pdserve.router.main import warn_if_open

    assert parse_key_lines("a\n# c\n b priority=3\n\nc priority=-1") == {"a": 0, "b": 3, "c": -1}
    with pytest.raises(ValueError, match="line 1"):
        parse_key_lines("a prio=3")
    with caplog.at_level("WARNING"):
        warn_if_open(RouterConfig(model_dir="m"), "127.0.0.1")
        assert not caplog.records
        warn_if_open(RouterConfig(model_dir="m", api_keys=("k",)), "0.0.0.0")
        assert not caplog.records
        warn_if_open(RouterConfig(model_dir="m"), "0.0.0.0")
    assert "no API key" in caplog.text


def _stalled_reader(url: str, body: bytes) -> socket.socket:
    """A streaming request from a client that reads nothing: a tiny receive buffer, set
    before connecting, so the router's writes back up after a few hundred chunks."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect((host, int(port)))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return s


async def test_a_client_that_stops_reading_is_aborted_and_others_go_on(cluster_factory) -> None:
    """A stream whose client stops reading is aborted after --stream-write-timeout (the
    worker is told to abort: its KV is freed) while another stream keeps its pace. Before
    the fix the stalled stream held its worker request until the client went away."""
    cfg = {"stream_write_timeout_s": 1.0, "disagg_threshold": 10_000}
    async with cluster_factory(**cfg) as c, httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        c.decode[0].token_delay_s = 0.002
        # 16 choices of 2000 tokens: some MB of SSE, more than the socket buffers hold
        big = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2000, "n": 16, "stream": true}'
        sock = await asyncio.to_thread(_stalled_reader, c.url, big)
        try:
            while not c.decode[0].active:
                await asyncio.sleep(0.01)
            gaps: list[float] = []
            body = {**OK, "max_tokens": 300, "stream": True}
            async with h.stream("POST", "/v1/completions", json=body) as r:
                last = time.perf_counter()
                async for _ in r.aiter_lines():
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now
            assert len(gaps) > 300 and max(gaps) < 0.5, max(gaps)
            for _ in range(1500):  # aborted within about 1.25 s quiet; up to 15 s loaded
                if c.decode[0].aborted:
                    break
                await asyncio.sleep(0.01)
            assert c.decode[0].aborted, "the stalled stream was not aborted"
            assert c.runtime.metrics.slow_readers._value.get() == 1
            assert c.runtime.active == 0
        finally:
            sock.close()
        await c.settle()


async def test_admin_port_opens_admin_endpoints_without_a_key(cluster_factory) -> None:
    """With --admin-port, /metrics and /workers answer there without a key (the operator's
    scrape), while the API port still refuses a tenant key; the API on the admin port
    still needs a key, and LoRA load/unload need the admin key there too (issue 44)."""
    import socket

    import uvicorn

    # The test holds the admin port bound from the start: a port picked free and bound
    # later can be taken meanwhile by the cluster's own connections (CI saw EADDRINUSE).
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    async with cluster_factory(
        api_keys=("tenant",), admin_api_keys=("boss",), admin_port=port
    ) as c:
        config = uvicorn.Config(c.app, log_level="warning", lifespan="off")  # a second port
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient() as h:
                admin = f"http://127.0.0.1:{port}"
                for path in ("/metrics", "/workers"):
                    assert (await h.get(admin + path)).status_code == 200
                    tenant = {"Authorization": "Bearer tenant"}
                    assert (await h.get(c.url + path, headers=tenant)).status_code == 403
                r = await h.post(admin + "/v1/completions", json=OK)
                assert r.status_code == 401
                # routes that change state need the admin key on the admin port too
                load = {"lora_name": "evil", "lora_path": "/etc"}
                r = await h.post(admin + "/v1/load_lora_adapter", json=load)
                assert r.status_code == 401, r.text
                r = await h.post(admin + "/v1/unload_lora_adapter", json={"lora_name": "x"})
                assert r.status_code == 401, r.text
                tenant = {"Authorization": "Bearer tenant"}
                r = await h.post(admin + "/v1/load_lora_adapter", json=load, headers=tenant)
                assert r.status_code == 403, r.text
                assert c.runtime.loras.get("evil") is None
        finally:
            server.should_exit = True
            await task
        await c.settle()
