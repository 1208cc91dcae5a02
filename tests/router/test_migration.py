"""Stream migration against fake workers: a decode worker that breaks mid-stream hands
the request to the next one with every token already sent; a request fault is not moved.

The fakes (pdserve/testing/router_fakes.py) continue a resumed request from where the
``resume_token_ids`` leave it, so the client's text shows a repeated or missing
token at once. The same with real workers and ``kill -9``: tests/local/test_up_resilience.py.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.test_api import LONG, client

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _first(c) -> int:
    """Index of the decode worker that round-robin routing tries first (sorted by URL)."""
    return c.decode_urls.index(sorted(c.decode_urls)[0])


async def _migrated(c) -> float:
    async with httpx.AsyncClient() as h:  # the router runs in this event loop
        text = (await h.get(c.url + "/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("pdserve_router_migrated_streams"))
    return float(line.split()[-1])


async def _text_before_error(c, match: str) -> str:
    """Stream a short completion that must end in an error matching ``match``; the text
    the client got before it."""
    stream = await client(c.url).completions.create(
        model="tiny", prompt="hi", max_tokens=10, stream=True
    )
    got = []
    with pytest.raises(openai.APIError, match=match):
        async for ch in stream:
            got.append(ch.choices[0].text)
    return "".join(got)


@pytest.mark.parametrize("threshold", [16, 10_000])  # remote prefill, local prefill
async def test_stream_moves_to_another_decode_worker(cluster_factory, threshold: int) -> None:
    async with cluster_factory(n_decode=2, disagg_threshold=threshold, picker="round-robin") as c:
        dead = _first(c)
        c.decode[dead].fail = "mid-stream"
        stream = await client(c.url).completions.create(
            model="tiny", prompt=LONG, max_tokens=10, stream=True
        )
        text = "".join([ch.choices[0].text async for ch in stream])
        remote = threshold == 16
        want = " ".join(f"t{i}" for i in range(9 if remote else 10))
        assert text.endswith(" " + want) and (text.startswith("<") == remote)
        survivor = c.decode[1 - dead].requests[-1]
        assert survivor.kv_handle is None and len(survivor.resume_token_ids or []) == 2 + remote
        assert await _migrated(c) == 1
        await c.settle()


async def test_non_streaming_request_moves_too(cluster_factory) -> None:
    async with cluster_factory(n_decode=2, disagg_threshold=10_000, picker="round-robin") as c:
        c.decode[_first(c)].fail = "mid-stream"
        out = await client(c.url).completions.create(model="tiny", prompt="hi", max_tokens=6)
        assert out.choices[0].text == " t0 t1 t2 t3 t4 t5"
        assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
        assert await _migrated(c) == 1
        await c.settle()


async def test_request_fault_mid_stream_is_not_migrated(cluster_factory) -> None:
    async with cluster_factory(n_decode=2, disagg_threshold=10_000, picker="round-robin") as c:
        first = _first(c)
        c.decode[first].fail = "error-mid"
        assert await _text_before_error(c, "request failed: injected") == " t0 t1"
        assert c.decode[1 - first].requests == [] and await _migrated(c) == 0
        await c.settle()


async def test_no_survivor_ends_the_stream_with_an_error(cluster_factory) -> None:
    async with cluster_factory(n_decode=2, disagg_threshold=10_000, failover_wait_s=0) as c:
        for st in c.decode:
            st.fail = "mid-stream"
        got = await _text_before_error(c, "no other could take over")
        assert got == " t0 t1 t2 t3"  # two tokens from each worker, none twice
        assert await _migrated(c) == 1  # moved once; the second failure had nowhere to go
        await c.settle()


async def test_lone_decode_worker_that_comes_back_takes_its_stream_back(cluster_factory) -> None:
    """One decode worker, broken mid-stream, back at the next health round (a restart): the
    stream waits for it and goes on, nothing lost or repeated."""
    async with cluster_factory(n_decode=1, disagg_threshold=10_000) as c:
        c.decode[0].fail = "mid-stream-once"
        stream = await client(c.url).completions.create(
            model="tiny", prompt="hi", max_tokens=6, stream=True
        )
        assert "".join([ch.choices[0].text async for ch in stream]) == " t0 t1 t2 t3 t4 t5"
        first, resumed = c.decode[0].requests[-2:]
        assert first.request_id == resumed.request_id and len(resumed.resume_token_ids) == 2
        assert first.request_id in c.decode[0].aborted  # dropped before the id came back
        assert await _migrated(c) == 1
        await c.settle()


async def test_a_decode_worker_that_keeps_failing_is_retried_a_bounded_number_of_times(
    cluster_factory,
) -> None:
    async with cluster_factory(n_decode=1, disagg_threshold=10_000, failover_wait_s=5) as c:
        c.decode[0].fail = "mid-stream"
        got = await _text_before_error(c, "no other could take over")
        assert got == " t0 t1 t2 t3 t4 t5"  # 1 try + 2 waits for it to come back, 2 tokens each
        assert len(c.decode[0].requests) == 3
        await c.settle()


async def _stalled(c, role: str = "decode") -> float:
    async with httpx.AsyncClient() as h:
        text = (await h.get(c.url + "/metrics")).text
    key = f'pdserve_router_stalled_streams_total{{role="{role}"}}'
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(key))


@pytest.mark.parametrize("fault", ["stall-mid", "stall-headers"])
async def test_stream_on_a_hung_worker_moves_on(cluster_factory, fault: str) -> None:
    """A worker that hangs closes nothing: its stream would wait request_timeout_s (600 s).
    Quiet for stall_timeout_s and failing its health check, it is cut and moves on."""
    async with cluster_factory(
        n_decode=2, disagg_threshold=10_000, picker="round-robin", stall_timeout_s=0.5
    ) as c:
        hung = _first(c)
        c.decode[hung].fail = fault
        stream = await client(c.url).completions.create(
            model="tiny", prompt="hi", max_tokens=6, stream=True
        )
        text = "".join([ch.choices[0].text async for ch in stream])
        assert text == " t0 t1 t2 t3 t4 t5"  # no token lost or repeated
        survivor = c.decode[1 - hung].requests[-1]
        assert len(survivor.resume_token_ids or []) == (2 if fault == "stall-mid" else 0)
        assert await _stalled(c) == 1
        assert await _migrated(c) == (1 if fault == "stall-mid" else 0)
        assert survivor.request_id in c.decode[hung].aborted  # its blocks are freed there
        await c.settle()


async def test_quiet_stream_on_a_healthy_worker_is_left_alone(cluster_factory) -> None:
    async with cluster_factory(n_decode=1, disagg_threshold=10_000, stall_timeout_s=0.3) as c:
        c.decode[0].fail, c.decode[0].quiet_s = "quiet-mid", 1.5  # 5x the stall timeout
        out = await client(c.url).completions.create(model="tiny", prompt="hi", max_tokens=4)
        assert out.choices[0].text == " t0 t1 t2 t3"
        assert await _stalled(c) == 0 and await _migrated(c) == 0
        await c.settle()


@pytest.mark.parametrize("n_prefill", [2, 1])  # the next prefill worker; a local prefill
async def test_prefill_on_a_hung_worker_moves_on(cluster_factory, n_prefill: int) -> None:
    async with cluster_factory(
        n_prefill=n_prefill, disagg_threshold=16, picker="round-robin", stall_timeout_s=0.5
    ) as c:
        hung = c.prefill_urls.index(sorted(c.prefill_urls)[0])
        c.prefill[hung].fail = "stall"
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=4)
        assert out.usage.completion_tokens == 4
        rid = c.prefill[hung].requests[-1].request_id
        assert rid in c.prefill[hung].aborted  # the hung worker is told to drop it
        if n_prefill == 2:
            assert c.prefill[1 - hung].requests[-1].request_id == rid
        else:  # the decode worker prefilled it: no handle
            assert c.decode[0].requests[-1].kv_handle is None
        assert await _stalled(c, "prefill") == 1 and await _stalled(c) == 0
        await c.settle()
