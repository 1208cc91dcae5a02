"""Which prefill worker holds which KV block: the router's prefix index.

Fed by the workers' KV events (ZeroMQ PUB, ``[b"kv", codec bytes]`` of a
``KVEvent{kind, worker_id, seq, block_hashes}``) and by the router's own routing
decisions (a prompt sent to a worker will be cached there; noting it at once
lets the next request of the same group follow before the worker's event
arrives). Bounded: beyond ``capacity`` block hashes (``--prefix-index-max-blocks``,
all workers together) the least recently stored or matched ones are forgotten, so a
router under a stream of distinct prompts holds bounded memory. A gap in a worker's
``seq`` drops that worker's entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

TOPIC = b"kv"


@dataclass(frozen=True)
class KVEventView:
    """The fields of a ``KVEvent`` the index reads (decoded from its codec JSON)."""

    kind: str
    worker_id: str
    seq: int
    block_hashes: tuple[int, ...]

    @classmethod
    def parse(cls, data: bytes) -> KVEventView:
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError("KV event is not a JSON object")
        kind = body.get("kind")
        if kind not in ("stored", "removed", "cleared"):
            raise ValueError(f"KV event has unknown kind {kind!r}")
        hashes = body.get("block_hashes") or []
        if not all(isinstance(h, int) for h in hashes):
            raise ValueError("KV event block_hashes must be integers")
        return cls(kind, str(body["worker_id"]), int(body["seq"]), tuple(hashes))


class PrefixIndex:
    """block hash → workers holding it, in LRU order. Single-threaded (the event loop)."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self._last_seq: dict[str, int] = {}
        self._held: dict[str, int] = {}  # worker_id -> block hashes it holds
        self.num_gaps = 0
        self.num_evicted = 0  # block hashes forgotten for the bound

    def __len__(self) -> int:
        return len(self._holders)

    def stored(self, worker_id: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None:
                self._holders[h] = holders = set()
            else:
                self._holders.move_to_end(h)
            if worker_id not in holders:
                holders.add(worker_id)
                self._held[worker_id] = self._held.get(worker_id, 0) + 1
        while len(self._holders) > self.capacity:
            _, gone = self._holders.popitem(last=False)
            self.num_evicted += 1
            for w in gone:
                self._held[w] -= 1

    def removed(self, worker_id: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and worker_id in holders:
                holders.remove(worker_id)
                self._held[worker_id] -= 1
                if not holders:
                    del self._holders[h]

    def drop_worker(self, worker_id: str) -> None:
        for h in [h for h, ws in self._holders.items() if worker_id in ws]:
            self.removed(worker_id, (h,))
        self._last_seq.pop(worker_id, None)

    def apply(self, ev: KVEventView) -> None:
        last = self._last_seq.get(ev.worker_id)
        if last is not None and ev.seq != last + 1:
            log.warning("KV events of %s: seq %d after %d, resyncing", ev.worker_id, ev.seq, last)
            self.num_gaps += 1
            self.drop_worker(ev.worker_id)
        self._last_seq[ev.worker_id] = ev.seq
        if ev.kind == "stored":
            self.stored(ev.worker_id, ev.block_hashes)
        elif ev.kind == "removed":
            self.removed(ev.worker_id, ev.block_hashes)
        else:
            self.drop_worker(ev.worker_id)
            self._last_seq[ev.worker_id] = ev.seq

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """worker_id → number of leading blocks of ``hashes`` that worker holds."""
        out: dict[str, int] = {}
        active: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            active = set(holders or ()) if active is None else active & (holders or set())
            if not active:
                break
            self._holders.move_to_end(h)
            for w in active:
                out[w] = i + 1
        return out

    def held(self) -> dict[str, int]:
        """worker_id → how many block hashes the index says it holds."""
        return {w: n for w, n in self._held.items() if n > 0}

    def last_seq(self, worker_id: str) -> int | None:
        return self._last_seq.get(worker_id)

    def workers(self) -> set[str]:
        return {w for ws in self._holders.values() for w in ws}


class KVEventSubscriber:
    """One ZeroMQ SUB socket per prefill worker, read by an asyncio task into the index."""

    def __init__(self, index: PrefixIndex, ctx: zmq.asyncio.Context | None = None) -> None:
        self.index = index
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # address -> reader
        self._worker_of: dict[str, str] = {}  # address -> worker_id
        self._stopping: set[asyncio.Task[None]] = set()  # cancelled, socket not closed yet
        self.num_events = 0
        self.num_bad = 0

    @property
    def addresses(self) -> set[str]:
        return set(self._tasks)

    def subscribe(self, address: str, worker_id: str) -> None:
        if address in self._tasks:
            return
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sock.connect(address)
        self._worker_of[address] = worker_id
        self._tasks[address] = asyncio.create_task(self._read(sock, address))

    def unsubscribe(self, address: str) -> None:
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        worker_id = self._worker_of.pop(address, None)
        if worker_id is not None:
            self.index.drop_worker(worker_id)

    async def close(self) -> None:
        for address in list(self._tasks):
            self.unsubscribe(address)
        for task in list(self._stopping):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _read(self, sock: zmq.asyncio.Socket, address: str) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 2 or frames[0] != TOPIC:
                    self.num_bad += 1
                    continue
                try:
                    ev = KVEventView.parse(frames[1])
                except (ValueError, KeyError, TypeError) as exc:
                    self.num_bad += 1
                    log.warning("bad KV event from %s: %s", address, exc)
                    continue
                self.num_events += 1
                self.index.apply(ev)
        finally:
            sock.close(linger=0)
