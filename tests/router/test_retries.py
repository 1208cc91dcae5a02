"""Retries, failover, health re-admission and client disconnects.

The fake workers (pdserve/testing/router_fakes.py) stand in for the real workers; they
fail on demand.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pdserve.coalesce import CoalescingHttpTools
from pdserve.router.discovery.workers import Discovery, StaticSource
from pdserve.testing.loopback import free_port
from pdserve.testing.router_fakes import FakeState, decode_app
from pdserve.worker_calls.worker_client import new_session
from tests.router.test_api import LONG, client

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def send_until_tried(url: str, st: FakeState, limit: int = 20) -> int:
    """Requests of 4 tokens, each served whole, until the failing decode worker ``st`` has
    been tried: both decode workers idle, the picker breaks the tie either way (each try
    costs the failing one a health mark; bounded). How many were sent."""
    sent = 0
    while not st.requests and sent < limit:
        out = await client(url).completions.create(model="tiny", prompt=LONG, max_tokens=4)
        assert out.choices[0].text.endswith(" t0 t1 t2")
        sent += 1
    assert st.requests, f"the failing decode worker was never tried in {sent}"
    return sent


def _ids(st: FakeState) -> list[str]:
    return [r.request_id for r in st.requests]


async def test_failed_prefill_worker_is_retried_on_another(cluster_factory) -> None:
    # round-robin: both workers get tried first at some point
    async with cluster_factory(n_prefill=2, disagg_threshold=16, picker="round-robin") as c:
        c.prefill[0].fail = "500"
        for _ in range(4):  # whichever worker is tried first, every request succeeds
            out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
            assert out.choices[0].text.startswith("<")
        assert len(c.prefill[1].requests) == 4
        assert len(c.prefill[0].requests) >= 1  # it was tried, then left out of rotation
        await c.settle()


async def test_all_prefill_workers_down_falls_back_to_local_prefill(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, disagg_threshold=16) as c:
        for st in c.prefill:
            st.fail = "500"
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
        assert out.choices[0].text == " t0 t1 t2"
        assert c.decode[0].requests[-1].kv_handle is None
        await c.settle()


@pytest.mark.parametrize("handoff", ["router", "decode"])
async def test_prefill_refusal_is_passed_on_not_retried(cluster_factory, handoff: str) -> None:
    """A prefill worker's 400 is the client's, whoever made the call (``--pd-handoff``)."""
    async with cluster_factory(n_prefill=2, disagg_threshold=16, pd_handoff=handoff) as c:
        for st in c.prefill:
            st.fail = "400"
        async with httpx.AsyncClient(base_url=c.url) as h:
            resp = await h.post("/v1/completions", json={"model": "tiny", "prompt": LONG})
        assert resp.status_code == 400 and "injected refusal" in resp.json()["error"]["message"]
        assert sum(len(st.requests) for st in c.prefill) == 1
        await c.settle()


async def test_decode_failure_before_first_token_is_retried(cluster_factory) -> None:
    async with cluster_factory(n_decode=2, disagg_threshold=16) as c:
        c.decode[0].fail = "500"
        sent = await send_until_tried(c.url, c.decode[0])
        assert len(c.decode[1].requests) == sent  # every request was served there
        assert all(r.kv_handle for r in c.decode[1].requests)
        # A handle is single-use: the retry carries a fresh one, from a second prefill
        # (after the first lease was ended), and the first token already sent stays.
        tried = c.decode[0].requests[0]
        retry = next(r for r in c.decode[1].requests if r.request_id == tried.request_id)
        assert retry.kv_handle.nonce != tried.kv_handle.nonce
        assert retry.first_token_id == tried.first_token_id
        assert [r.request_id for r in c.prefill[0].requests].count(tried.request_id) == 2
        assert tried.request_id in c.prefill[0].aborted
        await c.settle()


async def test_decode_error_line_before_tokens_is_retried(cluster_factory) -> None:
    async with cluster_factory(n_decode=2, disagg_threshold=10_000) as c:
        c.decode[0].fail = "error-line"
        for _ in range(3):
            out = await client(c.url).completions.create(model="tiny", prompt="x", max_tokens=2)
            assert out.choices[0].text == " t0 t1"
        await c.settle()


async def test_decode_crash_mid_stream_ends_with_error_event(cluster_factory) -> None:
    async with cluster_factory(n_decode=1, disagg_threshold=16, failover_wait_s=0) as c:
        c.decode[0].fail = "mid-stream"
        stream = await client(c.url).completions.create(
            model="tiny", prompt=LONG, max_tokens=10, stream=True
        )
        got = []
        with pytest.raises(openai.APIError, match="mid-stream"):
            async for ch in stream:
                got.append(ch.choices[0].text)
        assert got[0].startswith("<") and "".join(got[1:]) == " t0 t1"
        rid = _ids(c.decode[0])[0]
        await _until(lambda: rid in c.decode[0].aborted and rid in c.prefill[0].aborted)
        await c.settle()


# The router's own protocol tells the client watch of a disconnect by a callback; any other
# server's (h11 here) through the ASGI ``http.disconnect`` a task awaits.
SERVERS = pytest.mark.parametrize("http", [CoalescingHttpTools, "h11"], ids=["router", "h11"])


@SERVERS
async def test_streaming_client_disconnect_aborts_on_workers(cluster_factory, http) -> None:
    async with cluster_factory(disagg_threshold=16, http=http) as c:
        c.decode[0].token_delay_s = 0.1
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 200, "stream": True}
        async with (
            httpx.AsyncClient(base_url=c.url, timeout=30) as h,
            h.stream("POST", "/v1/completions", json=body) as resp,
        ):
            lines = resp.aiter_lines()
            while not (await lines.__anext__()).startswith("data:"):
                pass
            await _until(lambda: bool(c.decode[0].active))
        rid = _ids(c.decode[0])[0]
        await _until(lambda: rid in c.decode[0].aborted)
        await c.settle()
        assert c.runtime.active == 0


@SERVERS
async def test_non_streaming_client_disconnect_aborts_on_workers(cluster_factory, http) -> None:
    async with cluster_factory(disagg_threshold=10_000, http=http) as c:
        c.decode[0].token_delay_s = 0.1
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 200}
            task = asyncio.create_task(h.post("/v1/completions", json=body))
            await _until(lambda: bool(c.decode[0].active))
            task.cancel()
        rid = _ids(c.decode[0])[0]
        await _until(lambda: rid in c.decode[0].aborted)
        await c.settle()
        await _until(lambda: c.runtime.active == 0)


@SERVERS
@pytest.mark.parametrize("handoff", ["router", "decode"])
async def test_disconnect_during_prefill_aborts_prefill(cluster_factory, handoff, http) -> None:
    """The prefill hangs until aborted; the client goes. With ``--pd-handoff decode`` the
    decode worker is the one waiting on the prefill: both hear the abort."""
    async with cluster_factory(disagg_threshold=16, pd_handoff=handoff, http=http) as c:
        c.prefill[0].fail = "hang"
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
            task = asyncio.create_task(
                h.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "stream": True})
            )
            await _until(lambda: bool(c.prefill[0].requests))
            task.cancel()
        rid = _ids(c.prefill[0])[0]
        await _until(lambda: rid in c.prefill[0].aborted)
        if handoff == "router":
            assert c.decode[0].requests == []
        else:
            await _until(lambda: rid in c.decode[0].aborted)
        await c.settle()
        await _until(lambda: c.runtime.active == 0)


async def test_health_checks_drop_and_readmit_workers() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with new_session() as h:
        disc = Discovery(StaticSource([], [url]), h, interval_s=0.05)
        snap = await disc.refresh()
        assert snap.decode == () and len(snap.workers) == 1 and not snap.workers[0].healthy
        app = decode_app(FakeState("decode", "d9"))
        # the fake must listen on the very port discovery knows: serve() picks its own,
        # so run uvicorn directly here
        import uvicorn

        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        task = asyncio.create_task(server.serve())
        await _until(lambda: server.started)
        snap = await disc.refresh()
        assert [w.worker_id for w in snap.decode] == ["d9"] and snap.decode[0].stats.kv_blocks_total
        disc.mark_failed(url)
        assert disc.snapshot().decode == ()
        assert [w.url for w in (await disc.refresh()).decode] == [url]  # re-admitted
        server.should_exit = True
        await task
        assert (await disc.refresh()).decode == ()


async def test_starting_worker_is_routed_before_the_next_round() -> None:
    """A listed worker that has never been healthy (starting) is asked for its /health
    between rounds: routed within a fraction of a second of its start, not a round later."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with new_session() as h:
        disc = Discovery(StaticSource([], [url]), h, interval_s=60.0)
        disc.start()
        await _until(lambda: disc.starting() == [url])
        import uvicorn

        app = decode_app(FakeState("decode", "d7"))
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        task = asyncio.create_task(server.serve())
        try:
            # a 60 s round: only the in-between checks can see it this soon
            await _until(lambda: bool(disc.snapshot().decode), timeout=10.0)
            assert disc.starting() == []
        finally:
            server.should_exit = True
            await task
            await disc.stop()
