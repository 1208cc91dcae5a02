"""The prefix index: LRU bound, seq gaps, matching, and real ZeroMQ PUB/SUB on loopback."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import pytest
import zmq
import zmq.asyncio

from pdserve.protocol.hashing import block_hashes
from pdserve.router.discovery.events import KVEventSubscriber
from pdserve.router.main import add_arguments, build_config
from pdserve.router.scheduling.prefix_index import KVEventView, PrefixIndex

pytestmark = pytest.mark.unit


def ev(kind: str, worker: str, seq: int, hashes: list[int]) -> KVEventView:
    return KVEventView(kind, worker, seq, tuple(hashes))


def wire(kind: str, worker: str, seq: int, hashes: list[int]) -> list[bytes]:
    # The codec form of the engine's KVEvent (docs/architecture.md, "KV events").
    body = {
        "type": "kv_event",
        "kind": kind,
        "worker_id": worker,
        "seq": seq,
        "block_hashes": hashes,
    }
    return [b"kv", json.dumps(body).encode()]


def test_match_counts_leading_blocks_per_worker() -> None:
    idx = PrefixIndex()
    hashes = block_hashes(list(range(80)), 16)  # 5 blocks
    idx.apply(ev("stored", "a", 0, hashes[:5]))
    idx.apply(ev("stored", "b", 0, hashes[:2]))
    idx.apply(ev("stored", "c", 0, hashes[1:5]))  # no first block: no prefix
    assert idx.match(hashes) == {"a": 5, "b": 2}
    idx.apply(ev("removed", "a", 1, hashes[3:4]))
    assert idx.match(hashes) == {"a": 3, "b": 2}
    assert idx.match([]) == {}
    assert idx.held() == {"a": 4, "b": 2, "c": 4}
    idx.drop_worker("c")
    assert idx.held() == {"a": 4, "b": 2}


def test_lru_capacity_forgets_least_recently_used() -> None:
    idx = PrefixIndex(capacity=4)
    idx.stored("w", [1, 2, 3, 4])
    assert idx.match([1]) == {"w": 1}  # touches 1
    idx.stored("w", [5, 6])
    assert len(idx) == 4
    assert idx.match([2]) == {} and idx.match([3]) == {}
    assert idx.match([1]) == {"w": 1} and idx.match([6]) == {"w": 1}
    assert idx.held() == {"w": 4}


def test_seq_gap_drops_only_that_workers_entries() -> None:
    idx = PrefixIndex()
    idx.apply(ev("stored", "a", 0, [1, 2]))
    idx.apply(ev("stored", "b", 0, [1, 2]))
    idx.apply(ev("stored", "a", 2, [7]))  # seq 1 was lost
    assert idx.num_gaps == 1
    assert idx.match([1, 2]) == {"b": 2}
    assert idx.match([7]) == {"a": 1}  # the event after the gap is applied
    idx.apply(ev("stored", "a", 3, [1]))  # in order again
    assert idx.match([1, 2]) == {"a": 1, "b": 2}


def test_cleared_event_and_worker_restart() -> None:
    idx = PrefixIndex()
    idx.apply(ev("stored", "a", 5, [1, 2]))
    idx.apply(ev("cleared", "a", 6, []))
    assert idx.match([1]) == {}
    idx.apply(ev("stored", "a", 7, [1]))
    idx.apply(ev("stored", "a", 0, [9]))  # restarted worker: seq starts over → resync
    assert idx.match([1]) == {} and idx.match([9]) == {"a": 1}


@pytest.mark.parametrize(
    "data",
    [b"not json", b"[]", b'{"kind": "stored"}', b'{"kind":"moved","worker_id":"a","seq":0}'],
)
def test_bad_events_are_refused(data: bytes) -> None:
    with pytest.raises((ValueError, KeyError)):
        KVEventView.parse(data)


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(30)
async def test_subscriber_over_real_zmq() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = PrefixIndex()
    sub = KVEventSubscriber(idx, ctx)
    sub.subscribe(f"tcp://127.0.0.1:{port}", "w1")
    try:
        # PUB/SUB drops messages until the subscription has propagated: publish a
        # probe until one lands, then the real sequence.
        seq = 0
        while sub.num_events == 0:
            await pub.send_multipart(wire("stored", "w1", seq, [100]))
            seq += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let any probe still in flight land
        await pub.send_multipart([b"kv", b"garbage"])
        await pub.send_multipart([b"other-topic", b"{}"])  # not subscribed: never seen
        await _until(lambda: sub.num_bad == 1)
        nxt = (idx.last_seq("w1") or 0) + 1
        before = idx.num_gaps
        hashes = block_hashes(list(range(64)), 16)
        await pub.send_multipart(wire("stored", "w1", nxt, hashes))
        await _until(lambda: idx.match(hashes) == {"w1": 4})
        await pub.send_multipart(wire("removed", "w1", nxt + 1, hashes[2:]))
        await _until(lambda: idx.match(hashes) == {"w1": 2})
        # one engine step's events in one message, applied in order
        step = [*wire("stored", "w1", nxt + 2, [7, 8]), wire("removed", "w1", nxt + 3, [8])[1]]
        await pub.send_multipart(step)
        await _until(lambda: idx.match([7]) == {"w1": 1} and idx.last_seq("w1") == nxt + 3)
        assert idx.match([7, 8]) == {"w1": 1}
        await pub.send_multipart(wire("stored", "w1", nxt + 5, [42]))  # gap
        await _until(lambda: idx.num_gaps > before)
        assert idx.match(hashes) == {} and idx.match([42]) == {"w1": 1}
        sub.unsubscribe(f"tcp://127.0.0.1:{port}")
        assert idx.match([42]) == {}
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.term()


def test_parses_the_engines_own_kv_event_codec() -> None:
    kv_events = pytest.importorskip("pdserve.protocol.kv_events")
    from pdserve.protocol.codec import encode

    data = encode(kv_events.KVEvent(kind="removed", worker_id="w7", seq=3, block_hashes=[5, 6]))
    assert KVEventView.parse(data) == KVEventView("removed", "w7", 3, (5, 6))


def test_bound_holds_under_distinct_prompts_and_keeps_the_hot_prefix() -> None:
    """A stream of never-repeated prompts (the 1,000-streams case) cannot grow the index
    past its bound, evictions are counted, the per-worker counts stay exact, and a prefix
    matched on every request survives. An unbounded index, or one that evicts the most
    recently used, fails this."""
    idx = PrefixIndex(capacity=64)
    hot = block_hashes(list(range(64)), 16)  # 4 blocks every request starts with
    idx.stored("a", hot)
    for i in range(500):
        assert idx.match(hot) == {"a": 4}
        prompt = list(range(64)) + [10_000 + i] * 32  # the hot prefix, then 2 new blocks
        idx.stored("ab"[i % 2], block_hashes(prompt, 16)[4:])
        assert len(idx) <= 64
    assert len(idx) == 64 and idx.num_evicted == 4 + 2 * 500 - 64
    assert sum(idx.held().values()) == 64  # every kept hash has one holder here


def test_cli_sets_the_bound_and_refuses_a_bad_one() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "/m", "--decode", "h:1", "--prefix-index-max-blocks", "5"])
    assert build_config(args).prefix_index_capacity == 5
    args.prefix_index_max_blocks = 0
    with pytest.raises(ValueError, match="prefix-index-max-blocks"):
        build_config(args)


async def test_router_metrics_show_the_bounded_index(cluster_factory) -> None:
    """Through the router (prefill on every request): the index stays at the configured
    bound and /metrics reports its size and the evictions."""

    async with cluster_factory(disagg_threshold=0, prefix_index_capacity=6) as c:
        async with httpx.AsyncClient(base_url=c.url, timeout=30) as http:
            for i in range(5):  # 5 distinct 64-token prompts: 4 blocks each
                body = {"model": "tiny", "prompt": [100 + i] * 64, "max_tokens": 2}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            await asyncio.sleep(0.2)  # the workers' own events land too
            text = (await http.get("/metrics")).text
        assert len(c.runtime.index) <= 6
        assert "pdserve_router_prefix_index_blocks 6.0" in text
        evicted = c.runtime.index.num_evicted
        assert evicted >= 14 and f"pdserve_router_prefix_index_evicted_blocks {evicted}.0" in text
        await c.settle()


@pytest.mark.timeout(30)
async def test_a_burst_is_read_in_bounded_turns() -> None:
    """A burst of events larger than one read's bound (``DRAIN``) is read to its end over
    several loop turns (ZeroMQ's FD signals once for all of them), and the loop keeps
    turning in between: a flood of events never holds the router's requests."""
    from pdserve.router.discovery.events import DRAIN

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    idx = PrefixIndex()
    sub = KVEventSubscriber(idx, ctx)
    sub.subscribe(f"tcp://127.0.0.1:{port}", "w1")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    try:
        seq = 0
        while sub.num_events == 0:  # the subscription has reached the publisher
            await pub.send_multipart(wire("stored", "w1", seq, [seq]))
            seq += 1
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        start, n = (idx.last_seq("w1") or 0) + 1, 3 * DRAIN + 5
        seen: list[int] = []  # the ticker's count when each event was applied
        apply = idx.apply
        idx.apply = lambda ev: (seen.append(ticks), apply(ev))[1]  # type: ignore[method-assign]
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        for i in range(start, start + n):
            pub.send_multipart(wire("stored", "w1", i, [10_000 + i]), zmq.NOBLOCK)
        time.sleep(0.3)  # the loop held: all of it queued at the subscriber before a read
        await _until(lambda: idx.last_seq("w1") == start + n - 1)
        task.cancel()
        assert idx.num_gaps == 0 and idx.match([10_000 + start + n - 1]) == {"w1": 1}
        assert len(seen) == n and len(set(seen)) >= 3  # the loop turned between the reads
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.term()
