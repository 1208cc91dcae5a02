"""A router replica's view from the workers' event streams (router/discovery/events.py):
catch-up from a snapshot plus the events after it, resync on a gap or a report that says
an event went missing, load from the reports with this replica's own count as the
correction, over real ZeroMQ PUB/SUB on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio

from pdserve.protocol.codec import encode
from pdserve.protocol.contract import WorkerStats
from pdserve.protocol.kv_events import KVEvent, KVSnapshot, LoadReport
from pdserve.router.discovery.events import EventSubscriber, parse_report
from pdserve.router.discovery.workers import Discovery, EndpointSource
from pdserve.router.scheduling.prefix_index import PrefixIndex
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

pytestmark = pytest.mark.unit


def kv(seq: int, kind: str = "stored", hashes: tuple[int, ...] = ()) -> list[bytes]:
    return [b"kv", encode(KVEvent(kind, "p0", seq, list(hashes)))]


def report(kv_seq: int, running: int = 0) -> list[bytes]:
    return [b"stats", encode(LoadReport(running=running, worker_id="p0", kv_seq=kv_seq))]


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


class Worker:
    """A PUB socket standing in for a prefill worker's stream, and its /kv_blocks."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.held: set[int] = set()
        self.seq = 0
        self.fetches = 0
        self.gate: asyncio.Event | None = None  # a fetch waits for it (events meanwhile)
        self.no_endpoint = False

    async def event(self, kind: str, hashes: tuple[int, ...] = (), send: bool = True) -> None:
        self.seq += 1
        if kind == "stored":
            self.held.update(hashes)
        elif kind == "removed":
            self.held.difference_update(hashes)
        if send:  # send=False: the event is lost on the way (a dropped message)
            await self.pub.send_multipart(kv(self.seq, kind, hashes))

    async def fetch(self, url: str) -> KVSnapshot:
        assert url == "http://p0"
        self.fetches += 1
        if self.no_endpoint:
            raise ValueError("GET http://p0/kv_blocks answered 404")
        snap = KVSnapshot("p0", self.seq, sorted(self.held))
        if self.gate is not None:
            await self.gate.wait()
        return snap


Setup = tuple["Worker", PrefixIndex, EventSubscriber]


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    ctx = zmq.asyncio.Context()
    w = Worker(ctx)
    idx = PrefixIndex()
    sub = EventSubscriber(idx, ctx, fetch=w.fetch)
    yield w, idx, sub
    await sub.close()
    w.pub.close(linger=0)
    ctx.term()


async def live(w: Worker, sub: EventSubscriber) -> None:
    """Reports until the subscription has propagated (PUB drops messages before)."""
    while sub.num_reports == 0:
        await w.pub.send_multipart(report(w.seq))
        await asyncio.sleep(0.02)


async def synced(setup: Setup) -> Setup:
    """``setup`` with the worker subscribed as p0, live and synced from its snapshot."""
    w, _, sub = setup
    sub.subscribe(w.address, "p0", "http://p0")
    await live(w, sub)
    await until(lambda: sub.synced(w.address))
    return setup


@pytest.mark.timeout(30)
async def test_late_replica_catches_up_from_snapshot_then_events(setup: Setup) -> None:
    w, idx, sub = setup
    for i in range(5):  # before the replica exists: only the snapshot has these
        await w.event("stored", (100 + i,), send=False)
    await w.event("removed", (101,), send=False)
    w.gate = asyncio.Event()  # the snapshot takes a while: events arrive meanwhile
    sub.subscribe(w.address, "p0", "http://p0")
    assert not sub.synced(w.address)
    await live(w, sub)
    await until(lambda: w.fetches == 1)
    await w.event("stored", (200,))
    await w.event("removed", (100,))
    await until(lambda: sub.num_events == 2)
    assert not sub.synced(w.address) and idx.match([200]) == {}
    w.gate.set()
    await until(lambda: sub.synced(w.address))
    assert idx.held() == {"p0": len(w.held)} and idx.match([102, 103]) == {"p0": 2}
    assert all(idx.match([h]) == {"p0": 1} for h in w.held)
    assert idx.match([100]) == {} and idx.match([101]) == {}
    assert idx.last_seq("p0") == w.seq
    await w.event("stored", (300,))
    await until(lambda: idx.match([300]) == {"p0": 1})
    assert w.fetches == 1


@pytest.mark.timeout(30)
async def test_a_seq_gap_resyncs_from_a_snapshot(setup: Setup) -> None:
    w, idx, sub = await synced(setup)
    await w.event("stored", (1, 2))
    await until(lambda: idx.match([1, 2]) == {"p0": 2})
    await w.event("stored", (3,), send=False)  # lost
    await w.event("removed", (1,), send=False)  # lost
    await w.event("stored", (4,))  # seq jumps: the replica fetches the worker's blocks
    await until(lambda: w.fetches == 2 and sub.synced(w.address) and idx.match([3]) != {})
    assert {h for h in (1, 2, 3, 4) if idx.match([h])} == w.held == {2, 3, 4}
    assert sub.num_resyncs == 2


@pytest.mark.timeout(30)
async def test_a_report_ahead_of_the_index_resyncs(setup: Setup) -> None:
    w, idx, _ = await synced(setup)
    await w.event("stored", (7,), send=False)  # the last event was lost: no later one
    await w.pub.send_multipart(report(w.seq))  # ... but the report says seq 1 was sent
    await until(lambda: idx.match([7]) == {"p0": 1})
    assert w.fetches == 2
    # The worker restarts: an empty cache, seq from 0; its report says so before any event.
    w.held.clear()
    w.seq = 0
    await w.pub.send_multipart(report(0))
    await until(lambda: w.fetches == 3 and idx.match([7]) == {} and idx.last_seq("p0") == 0)


@pytest.mark.timeout(30)
async def test_a_worker_without_kv_blocks_is_not_synced_until_it_has_them(
    setup: Setup,
) -> None:
    """No snapshot-less following (an older worker's, retired): the snapshot is fetched
    again until it comes, and the events meanwhile are held, then applied after it."""
    w, idx, sub = setup
    w.no_endpoint = True
    await w.event("stored", (8,))  # before the subscription: only the snapshot has it
    sub.subscribe(w.address, "p0", "http://p0")  # fetched at once: refused, again later
    await until(lambda: w.fetches == 1)
    await w.event("stored", (9,))
    await asyncio.sleep(0.1)
    assert not sub.synced(w.address) and idx.match([8]) == {}
    w.no_endpoint = False
    await until(lambda: sub.synced(w.address), timeout=5)  # the retry, RETRY_S later
    assert idx.match([8]) == {"p0": 1} and idx.match([9]) == {"p0": 1} and w.fetches == 2


@pytest.mark.timeout(30)
async def test_decode_feed_is_synced_at_its_first_report(setup: Setup) -> None:
    w, _, sub = setup
    sub.subscribe(w.address, "p0", "http://p0", kv=False)
    assert not sub.synced(w.address)
    await live(w, sub)
    assert sub.synced(w.address) and w.fetches == 0
    got = sub.report("p0")
    assert got is not None and got[1] < 1.0


class NoSource(EndpointSource):
    async def list(self) -> list:  # type: ignore[type-arg]
        return []


async def test_load_is_the_report_plus_what_this_replica_sent_since() -> None:
    now = [100.0]
    sub = EventSubscriber(PrefixIndex(), fetch=None, clock=lambda: now[0])
    d = Discovery(NoSource(), client=None, subscriber=sub)  # type: ignore[arg-type]
    stats = WorkerStats(worker_id="p0", running=0, queued_prompt_tokens=0)
    d._views["http://p0"] = WorkerView("http://p0", "prefill", stats=stats)
    for _ in range(3):  # this replica's own: 3 requests, 300 prompt tokens
        d.begin("http://p0", 100)
    # Without a report: the polled stats, bounded by the own count (one router's rule).
    v = d.snapshot().workers[0]
    assert not v.reported and v.running == 3 and v.queued_tokens == 300
    # The worker reports 10 (every replica's), 3 of them ours: ours are not added twice.
    sub.loads["p0"] = (LoadReport(running=8, waiting=2, queued_prompt_tokens=900), now[0])
    v = d.snapshot().workers[0]
    assert v.reported and v.running == 10 and v.queued_tokens == 900
    d.begin("http://p0", 50)  # sent after the report: not in it yet
    v = d.snapshot().workers[0]
    assert v.running == 11 and v.queued_tokens == 950 and v.inflight == 4
    sub.loads["p0"] = (LoadReport(running=11, queued_prompt_tokens=950), now[0])
    assert d.snapshot().workers[0].running == 11  # the next report has it
    now[0] += 1.0  # stale: back to the polled stats and the own count
    v = d.snapshot().workers[0]
    assert not v.reported and v.running == 4


def test_snapshot_views_and_pools_are_those_the_dataclass_builds() -> None:
    """``Discovery.snapshot`` builds its views without WorkerView's ``__init__`` and fills
    the snapshot's pools as it goes: field for field what the dataclass and
    ``Snapshot.role`` give, reported or not, healthy or not."""
    now = [100.0]
    sub = EventSubscriber(PrefixIndex(), fetch=None, clock=lambda: now[0])
    d = Discovery(NoSource(), client=None, subscriber=sub)  # type: ignore[arg-type]
    for i, (role, healthy) in enumerate(
        [("prefill", True), ("prefill", False), ("decode", True), ("decode", True)]
    ):
        stats = WorkerStats(worker_id=f"w{i}", running=i, queued_prompt_tokens=10 * i)
        d._views[f"http://w{i}"] = WorkerView(f"http://w{i}", role, healthy, stats)
    d.begin("http://w0", 64)
    d.begin("http://w2", 0)
    sub.loads["w2"] = (LoadReport(running=5, worker_id="w2"), now[0])
    snap = d.snapshot()
    for v in snap.workers:
        fields = {f: getattr(v, f) for f in WorkerView.__dataclass_fields__}
        assert WorkerView(**fields) == v and type(v) is WorkerView
    assert [v.reported for v in snap.workers] == [False, False, True, False]
    assert snap.workers[2].since_report == 0 and snap.workers[0].inflight == 1
    fresh = Snapshot(snap.workers, snap.version)
    assert snap.prefill == fresh.role("prefill") and snap.decode == fresh.role("decode")
    assert [w.url for w in snap.prefill] == ["http://w0"]


def test_report_parser_matches_the_codec_and_refuses_bad_values() -> None:
    rep = LoadReport(
        running=3,
        waiting=1,
        kv_blocks_free=9,
        worker_id="p0",
        kv_seq=4,
        loras=["a"],
        compile="compiling",
        step_failures=1,
    )
    assert parse_report(encode(rep)) == rep
    for bad in (
        b"[]",
        b'{"type": "kv_event"}',
        b'{"type": "load_report", "running": -1}',
        b'{"type": "load_report", "running": true}',
        b'{"type": "load_report", "compile": 1}',
        b'{"type": "load_report", "loras": [1]}',
    ):
        with pytest.raises(ValueError):
            parse_report(bad)


def test_shift_is_begins_and_ends_at_once() -> None:
    """``Discovery.shift`` (the compiled lane's batch of tracks, net) leaves the counts
    that the same begins and ends one at a time leave, and refuses an underflow."""
    one, net = (Discovery(NoSource(), client=None) for _ in range(2))  # type: ignore[arg-type]
    url = "http://p0"
    for d in (one, net):
        d.begin(url, 100)
    for _ in range(3):
        one.begin(url, 64)
    one.end(url, 100)
    net.shift(url, 2, 3 * 64 - 100)
    assert one._inflight == net._inflight == {url: (3, 192)}
    net.shift(url, 0, -500)  # tokens never go below 0
    assert net._inflight[url] == (3, 0)
    with pytest.raises(AssertionError, match="underflow"):
        net.shift(url, -4, 0)
