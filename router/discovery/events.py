"""Every worker's event stream, read by every router replica: KV events into the prefix
index, load reports into a board routing scores from (``pdserve/protocol/kv_events.py``).

One ZeroMQ SUB socket per worker, read by a callback on its FD. A prefill worker's feed is
*synced* once the index holds that worker's blocks: its ``GET /kv_blocks`` snapshot,
fetched as soon as the socket is connected, plus every KV event after the snapshot's
``seq``. Events that arrive while the snapshot is on its way are held and applied after
it. A subscription takes a moment to reach the publisher, so events published meanwhile
are lost: the next load report (at least 10 a second) carries the ``kv_seq`` of the last
event sent before it, which shows that, and the feed resyncs. So does a ``seq`` gap
(the worker's entries are replaced, never left half right). A snapshot that cannot be had
is fetched again until it can: the feed is not synced meanwhile. A decode worker's feed
carries load reports only; it is synced at the first.
The router reports ready (``Discovery.synced``) once every healthy worker's feed is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from pdserve.protocol.kv_events import STATS_TOPIC, TOPIC, KVSnapshot, LoadReport
from pdserve.router.scheduling.prefix_index import KVEventView, PrefixIndex

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a failed snapshot fetch is tried again after this
DRAIN = 64  # messages read per call of the FD callback (EventSubscriber._drain)
# What fetches a worker's snapshot (raises when it cannot: it is fetched again).
Fetch = Callable[[str], Awaitable[KVSnapshot]]


@dataclass
class Feed:
    """One worker's stream, as this replica follows it."""

    address: str
    worker_id: str
    url: str
    kv: bool  # prefill: KV events into the index (decode: load reports only)
    synced: bool = False
    held: list[KVEventView] | None = None  # events waiting for a snapshot (resyncing)
    resync: asyncio.Task[None] | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class EventSubscriber:
    def __init__(
        self,
        index: PrefixIndex,
        ctx: zmq.asyncio.Context | None = None,
        fetch: Fetch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.fetch = fetch  # Discovery sets it (signed GET /kv_blocks); None: no catch-up
        self.clock = clock
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._feeds: dict[str, Feed] = {}  # address -> feed
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, not finished yet
        self.loads: dict[str, tuple[LoadReport, float]] = {}  # worker_id -> (report, when)
        self.num_events = 0
        self.num_reports = 0
        self.num_bad = 0
        self.num_resyncs = 0

    @property
    def addresses(self) -> set[str]:
        return set(self._feeds)

    def synced(self, address: str) -> bool:
        feed = self._feeds.get(address)
        return feed is not None and feed.synced

    def report(self, worker_id: str) -> tuple[LoadReport, float] | None:
        """The worker's last load report and its age in seconds."""
        got = self.loads.get(worker_id)
        return None if got is None else (got[0], self.clock() - got[1])

    # -- subscriptions --------------------------------------------------------------
    def subscribe(self, address: str, worker_id: str, url: str = "", kv: bool = True) -> None:
        if address in self._feeds:
            return
        # A plain socket of the same context: the feed reads it from a callback on its FD
        # (_read), not through zmq.asyncio's futures.
        sock: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.setsockopt(zmq.SUBSCRIBE, STATS_TOPIC)
        sock.connect(address)
        feed = Feed(address, worker_id, url, kv)
        # Without a way to fetch snapshots the index follows events from now on (synced).
        feed.synced = kv and (self.fetch is None or not url)
        self._feeds[address] = feed
        feed.tasks.append(asyncio.create_task(self._read(sock, feed)))
        if kv and not feed.synced:
            self._start_resync(feed, [])

    def unsubscribe(self, address: str) -> None:
        feed = self._feeds.pop(address, None)
        if feed is None:
            return
        tasks = [*feed.tasks, *([feed.resync] if feed.resync else [])]
        for task in tasks:
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        self.loads.pop(feed.worker_id, None)
        if feed.kv:
            self.index.drop_worker(feed.worker_id)

    async def close(self) -> None:
        for address in list(self._feeds):
            self.unsubscribe(address)
        for task in list(self._stopping):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- reading ------------------------------------------------------------------------
    async def _read(self, sock: zmq.Socket[bytes], feed: Feed) -> None:
        """The feed's socket, read by a callback on its FD (``_drain``) until the task is
        cancelled (``unsubscribe``). An awaited read per message (zmq.asyncio: a future, a
        task step, its own FD callback) cost ~3% of the router's CPU on the P/D path, where
        each request brings one KV event."""
        loop = asyncio.get_running_loop()
        fd = int(sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._drain, feed, sock, loop)
        try:
            self._drain(feed, sock, loop)  # what came before the callback was in place
            await loop.create_future()  # until cancelled
        finally:
            loop.remove_reader(fd)
            sock.close(linger=0)

    def _drain(self, feed: Feed, sock: zmq.Socket[bytes], loop: asyncio.AbstractEventLoop) -> None:
        """Read what is queued, at most DRAIN messages per call, so a flood of events cannot
        hold the loop (the rest on the loop's next turn). ZeroMQ's FD is edge-triggered: it
        signals a change, not a message, so the socket is read until it has none left and
        its EVENTS are looked at once more before the callback returns."""
        if sock.closed:
            return
        for _ in range(DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_frames(feed, frames)
        else:
            loop.call_soon(self._drain, feed, sock, loop)
            return
        if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            loop.call_soon(self._drain, feed, sock, loop)

    def _on_frames(self, feed: Feed, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.num_bad += 1
        elif frames[0] == TOPIC and feed.kv:  # one engine step's events, in seq order
            for data in frames[1:]:
                self._on_event(feed, data)
        elif frames[0] == STATS_TOPIC and len(frames) == 2:
            self._on_report(feed, frames[1])
        else:
            self.num_bad += 1

    def _on_event(self, feed: Feed, data: bytes) -> None:
        try:
            ev = KVEventView.parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            self.num_bad += 1
            log.warning("bad KV event from %s: %s", feed.address, exc)
            return
        self.num_events += 1
        if feed.held is not None:  # a snapshot is on its way: apply after it
            feed.held.append(ev)
            return
        last = self.index.last_seq(feed.worker_id)
        if (
            feed.synced
            and self.fetch is not None
            and feed.url
            and last is not None
            and ev.seq != last + 1
        ):
            log.warning("KV events of %s: seq %d after %d, resyncing", feed.worker_id, ev.seq, last)
            self._start_resync(feed, [ev])
            return
        self.index.apply(ev)

    def _on_report(self, feed: Feed, data: bytes) -> None:
        try:
            rep = parse_report(data)
        except (ValueError, KeyError, TypeError) as exc:
            self.num_bad += 1
            log.warning("bad load report from %s: %s", feed.address, exc)
            return
        self.num_reports += 1
        self.loads[feed.worker_id] = (rep, self.clock())
        if not feed.kv:
            feed.synced = True
        elif feed.held is None and feed.resync is None and self.fetch is not None and feed.url:
            last = self.index.last_seq(feed.worker_id) or 0
            # Ahead of the index: events before it went missing. Back at 0 with the index
            # past it: the worker restarted (its cache is empty; its next event may be
            # long in coming). An older report arriving after a snapshot is behind, not 0.
            restarted = rep.kv_seq == 0 and last > 0
            if rep.kv_seq > last or restarted:
                log.info(
                    "KV events of %s: report says seq %d, index at %d; resyncing",
                    feed.worker_id,
                    rep.kv_seq,
                    last,
                )
                self._start_resync(feed, [])

    # -- catching up ----------------------------------------------------------------
    def _start_resync(self, feed: Feed, held: list[KVEventView]) -> None:
        feed.held = held
        feed.resync = asyncio.create_task(self._resync(feed))

    async def _resync(self, feed: Feed) -> None:
        assert self.fetch is not None
        self.num_resyncs += 1
        while True:
            try:
                snap = await self.fetch(feed.url)
            except Exception as exc:  # the worker is busy or going away: try again
                log.info("KV snapshot of %s failed (%s); trying again", feed.url, exc)
                await asyncio.sleep(RETRY_S)
                continue
            break
        held, feed.held, feed.resync = feed.held or [], None, None
        self.index.load_snapshot(feed.worker_id, snap.seq, snap.block_hashes)
        for i, ev in enumerate(held):
            if ev.seq <= snap.seq:
                continue  # in the snapshot already
            if ev.seq != self.index.last_seq(feed.worker_id) + 1:  # type: ignore[operator]
                self._start_resync(feed, held[i:])  # some went missing: once more
                return
            self.index.apply(ev)
        feed.synced = True
        log.info(
            "KV index of %s synced at seq %d (%d blocks)",
            feed.worker_id,
            self.index.last_seq(feed.worker_id),
            len(snap.block_hashes),
        )


_LISTS = ("loras", "lora_known")
_STRS = ("worker_id", "compile", "fault")
_INTS = tuple(f.name for f in dataclasses.fields(LoadReport) if f.name not in (*_LISTS, *_STRS))


def parse_report(data: bytes) -> LoadReport:
    """A ``LoadReport`` from its codec JSON: the fields checked by hand (the general codec
    took ~80 µs a report here, and a busy worker sends up to 100 a second)."""
    body = json.loads(data)
    if not isinstance(body, dict) or body.get("type") != "load_report":
        raise ValueError("not a load_report")
    kw: dict[str, object] = {}
    for name in _INTS:
        v = body.get(name, 0)
        if type(v) is not int or v < 0:
            raise ValueError(f"load_report {name} must be a non-negative integer")
        kw[name] = v
    for name in _LISTS:
        v = body.get(name) or []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"load_report {name} must be a list of strings")
        kw[name] = v
    for name in _STRS:
        v = body.get(name, "")
        if not isinstance(v, str):
            raise ValueError(f"load_report {name} must be a string")
        kw[name] = v
    return LoadReport(**kw)  # type: ignore[arg-type]


# The name the rest of the router used for it before load reports joined the stream.
KVEventSubscriber = EventSubscriber
