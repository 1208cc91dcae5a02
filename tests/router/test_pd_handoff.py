"""``--pd-handoff decode``: the decode worker calls the prefill worker (decode_worker/chain.py).

The fake decode worker runs the real decode worker's ``PrefillChain`` against the fake
prefill workers (pdserve/testing/router_fakes.py), so these check the router's side (one call per
request, the candidates named, aborts reaching them) and the chain's failover together;
tests/workers/test_pd_handoff_real.py runs the real workers.
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.protocol.contract import GenerateRequest, InvalidParameter, KVHandle
from tests.router.test_api import LONG, client, stream_long
from tests.router.test_retries import send_until_tried

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
CHAIN = {"disagg_threshold": 16, "pd_handoff": "decode"}


async def test_one_call_at_the_router_and_the_same_stream(cluster_factory) -> None:
    async with cluster_factory(**CHAIN) as c:
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=4)
        first = c.prefill[0].requests[0]
        req = c.decode[0].requests[0]
        assert req.prefill == [c.prefill_urls[0]] and req.kv_handle is None
        assert first.request_id == req.request_id  # the decode worker's call, same id
        assert out.choices[0].text == f"<{100 + sum(first.prompt_token_ids) % 50}> t0 t1 t2"
        # the same text as the router's own handoff gives
        async with cluster_factory(disagg_threshold=16) as r:
            again = await client(r.url).completions.create(model="tiny", prompt=LONG, max_tokens=4)
        assert again.choices[0].text == out.choices[0].text
        await c.settle()


async def test_streamed_first_token_then_usage(cluster_factory) -> None:
    async with cluster_factory(**CHAIN) as c:
        chunks, texts = await stream_long(c.url, 3)
        # the first token leads (lines that came together may share a chunk)
        assert texts[0].startswith("<") and "".join(texts).endswith("> t0 t1")
        usage = chunks[-1].usage
        assert usage.completion_tokens == 3 and usage.prompt_tokens > 16
        await c.settle()


async def test_one_token_ends_at_the_prefill(cluster_factory) -> None:
    async with cluster_factory(**CHAIN) as c:
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=1)
        assert out.choices[0].text.startswith("<") and out.choices[0].finish_reason == "length"
        assert not c.prefill[0].leases
        await c.settle()


async def test_failed_prefill_worker_moves_to_the_next(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, picker="round-robin", **CHAIN) as c:
        c.prefill[0].fail = "500"
        for _ in range(4):
            out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
            assert out.choices[0].text.startswith("<") and out.choices[0].text.endswith(" t0 t1")
        assert len(c.prefill[1].requests) == 4  # every request got its prefill there
        assert c.prefill[0].requests, "the failing worker was never a candidate"
        assert set(c.prefill[0].aborted) >= {r.request_id for r in c.prefill[0].requests}
        await c.settle()


async def test_a_failed_prefill_worker_is_tried_last_for_a_while(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, picker="round-robin", **CHAIN) as c:
        c.prefill[0].fail = "500"  # its health check passes: the router keeps naming it
        for _ in range(6):
            out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=2)
            assert out.choices[0].text.startswith("<")
        firsts = [r.prefill[0] for r in c.decode[0].requests]
        assert firsts.count(c.prefill_urls[0]) >= 2  # named first again after it failed
        assert len(c.prefill[0].requests) == 1  # but called once: then tried last
        assert len(c.prefill[1].requests) == 6
        await c.settle()


async def test_every_prefill_worker_down_prefills_on_the_decode_worker(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, **CHAIN) as c:
        for st in c.prefill:
            st.fail = "500"
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
        assert out.choices[0].text == " t0 t1 t2"  # no "<first>": computed on the decode side
        assert sum(len(st.requests) for st in c.prefill) == 2
        assert c.decode[0].chain.local == 1
        await c.settle()


async def test_decode_failure_before_tokens_aborts_the_candidates_and_retries(
    cluster_factory,
) -> None:
    async with cluster_factory(n_decode=2, **CHAIN) as c:
        c.decode[0].fail = "500"
        await send_until_tried(c.url, c.decode[0])
        rid = c.decode[0].requests[0].request_id
        # the next decode worker got the same candidates, after an abort that would have
        # freed a lease the failed one held
        retry = next(r for r in c.decode[1].requests if r.request_id == rid)
        assert retry.prefill == [c.prefill_urls[0]]
        assert rid in c.prefill[0].aborted
        await c.settle()


async def test_a_hung_prefill_worker_costs_the_stall_timeout_not_the_call_timeout(
    cluster_factory,
) -> None:
    """p0 hangs on its first call and fails its health check from then on (a stopped
    process). The decode worker waits on it (its own timeout is 30 s here); the router
    cuts that call after ``stall_timeout_s``, aborts the request (ending the decode
    worker's wait) and sends it again naming only p1. The decode worker is not blamed."""
    async with cluster_factory(
        n_prefill=2, picker="round-robin", stall_timeout_s=0.5, **CHAIN
    ) as c:
        c.prefill[0].fail = "stall"
        t0 = asyncio.get_running_loop().time()
        for _ in range(2):  # round-robin: one of them names p0 first
            out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
            assert out.choices[0].text.startswith("<") and out.choices[0].text.endswith(" t1")
        assert asyncio.get_running_loop().time() - t0 < 10
        rid = c.prefill[0].requests[0].request_id
        sent = [r.prefill for r in c.decode[0].requests if r.request_id == rid]
        assert sent == [c.prefill_urls, [c.prefill_urls[1]]]
        assert rid in c.decode[0].aborted and rid in c.prefill[0].aborted
        assert not c.decode[0].chaining  # the first call's wait was ended, not left running
        assert c.runtime.discovery.snapshot().decode  # the decode worker stays in rotation
        await c.settle()


async def test_decode_crash_after_the_first_token_migrates(cluster_factory) -> None:
    async with cluster_factory(**CHAIN) as c:
        c.decode[0].fail = "mid-stream-once"  # breaks after 2 tokens, then serves (restarted)
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=6)
        assert out.choices[0].text.startswith("<") and out.choices[0].text.endswith(" t4")
        moved = [r for r in c.decode[0].requests if r.resume_token_ids]
        assert len(moved) == 1 and moved[0].prefill is None and moved[0].kv_handle is None
        assert len(c.prefill[0].requests) == 1  # the prompt was not prefilled again
        await c.settle()


def test_generate_request_refuses_a_bad_candidate_list() -> None:
    handle = KVHandle("r", "a", "tcp://x", [0], 4, [], 16, "n", 30.0)
    for bad in ([], ["ftp://x"], ["http://x"] * 9, ["http://a\nb"]):
        with pytest.raises(InvalidParameter, match="prefill"):
            GenerateRequest("r", [1, 2], prefill=bad).validate()
    with pytest.raises(InvalidParameter, match="prefill"):
        GenerateRequest(
            "r", [1, 2], kv_handle=handle, first_token_id=3, prefill=["http://a"]
        ).validate()
    with pytest.raises(InvalidParameter, match="prefill"):
        GenerateRequest("r", [1, 2], resume_token_ids=[5], prefill=["http://a"]).validate()
    GenerateRequest("r", [1, 2], prefill=["http://127.0.0.1:1", "https://p"]).validate()


async def test_the_real_decode_worker_ends_a_chained_wait_on_abort() -> None:
    """DecodeWorker's side of the above, without an engine (no model needed for it): an
    abort of the request id cancels its prefill wait, and so does a second call of the
    same id (the router's retry landing here), which then waits in its place."""
    from pdserve.decode_worker.server import DecodeWorker

    class Hanging:
        async def prefill(self, req: GenerateRequest) -> None:
            await asyncio.Event().wait()

    worker = DecodeWorker.__new__(DecodeWorker)  # the chain logic only: no engine process
    worker.chain, worker._chaining = Hanging(), {}  # type: ignore[assignment]
    req = GenerateRequest("r1", [1, 2, 3], prefill=["http://127.0.0.1:1"])
    first = asyncio.create_task(worker._prefill_abortable(req))
    await asyncio.sleep(0.01)
    assert worker.abort_chain("r1") and not worker.abort_chain("r1")
    with pytest.raises(asyncio.CancelledError):
        await first
    again = asyncio.create_task(worker._prefill_abortable(req))
    await asyncio.sleep(0.01)
    retry = asyncio.create_task(worker._prefill_abortable(req))  # same id: the old one ends
    await asyncio.sleep(0.01)
    assert again.cancelled() and not retry.done() and worker._chaining["r1"] is retry
    retry.cancel()
    with pytest.raises(asyncio.CancelledError):
        await retry
    assert worker._chaining == {}
