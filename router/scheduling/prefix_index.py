"""Which prefill worker holds which KV block: the router's prefix index.

Fed by the workers' KV events (ZeroMQ PUB, ``[b"kv", codec bytes]`` of a
``KVEvent{kind, worker_id, seq, block_hashes}``, read by ``router/discovery/events.py``),
by a worker's snapshot (``GET /kv_blocks``) when a replica starts late or resyncs, and
by the router's own routing decisions (a prompt sent to a worker will be cached there;
noting it at once lets the next request of the same group follow before the worker's
event arrives). Bounded: beyond ``capacity`` block hashes (``--prefix-index-max-blocks``,
all workers together) the least recently stored or matched ones are forgotten, so a
router under a stream of distinct prompts holds bounded memory. A gap in a worker's
``seq`` drops that worker's entries.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.scheduling.tier_index import TIERS, TierIndex

log = logging.getLogger(__name__)

TOPIC = b"kv"


@dataclass(frozen=True)
class KVEventView:
    """The fields of a ``KVEvent`` the index reads (decoded from its codec JSON)."""

    kind: str
    worker_id: str
    seq: int
    block_hashes: tuple[int, ...]
    tier: str = "pool"  # "host" | "disk" | "shared": a KV tier below the pool (tier_index.py)

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
        tier = body.get("tier") or "pool"
        if tier not in ("pool", *TIERS):
            raise ValueError(f"KV event has unknown tier {tier!r}")
        return cls(kind, str(body["worker_id"]), int(body["seq"]), tuple(hashes), tier)


class Mirror(Protocol):
    """A copy of the index kept elsewhere (the compiled lane's planner, router/lane_plan.py):
    told every change to a worker's pool blocks, and whether a KV tier holds any."""

    def kv_stored(self, worker_id: str, hashes: Sequence[int]) -> None: ...
    def kv_removed(self, worker_id: str, hashes: Sequence[int]) -> None: ...
    def kv_drop(self, worker_id: str) -> None: ...
    def set_tiers_present(self, present: bool) -> None: ...


class PrefixIndex:
    """block hash → workers holding it, in LRU order. Single-threaded (the event loop)."""

    def __init__(self, capacity: int = 1_000_000, tiers: TierIndex | None = None) -> None:
        assert capacity > 0
        self.capacity = capacity
        self.tiers = tiers or TierIndex(capacity)  # the workers' KV tiers below their pools
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self._last_seq: dict[str, int] = {}
        self._held: dict[str, int] = {}  # worker_id -> block hashes it holds
        self.num_gaps = 0
        self.num_evicted = 0  # block hashes forgotten for the bound
        self.mirror: Mirror | None = None

    def __len__(self) -> int:
        return len(self._holders)

    def stored(self, worker_id: str, hashes: Sequence[int]) -> None:
        if self.mirror is not None:
            self.mirror.kv_stored(worker_id, hashes)
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
        if self.mirror is not None:
            self.mirror.kv_removed(worker_id, hashes)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and worker_id in holders:
                holders.remove(worker_id)
                self._held[worker_id] -= 1
                if not holders:
                    del self._holders[h]

    def drop_worker(self, worker_id: str) -> None:
        mirror, self.mirror = self.mirror, None  # one drop for the mirror, not a removal a block
        try:
            for h in [h for h, ws in self._holders.items() if worker_id in ws]:
                self.removed(worker_id, (h,))
        finally:
            self.mirror = mirror
        if mirror is not None:
            mirror.kv_drop(worker_id)
        self.tiers.drop_worker(worker_id)
        self._tiers_changed()
        self._last_seq.pop(worker_id, None)

    def apply(self, ev: KVEventView) -> None:
        last = self._last_seq.get(ev.worker_id)
        if last is not None and ev.seq != last + 1:
            log.warning("KV events of %s: seq %d after %d, resyncing", ev.worker_id, ev.seq, last)
            self.num_gaps += 1
            self.drop_worker(ev.worker_id)
        self._last_seq[ev.worker_id] = ev.seq
        if ev.tier != "pool" and ev.kind != "cleared":
            apply = self.tiers.stored if ev.kind == "stored" else self.tiers.removed
            apply(ev.worker_id, ev.tier, ev.block_hashes)
            self._tiers_changed()
        elif ev.kind == "stored":
            self.stored(ev.worker_id, ev.block_hashes)
        elif ev.kind == "removed":
            self.removed(ev.worker_id, ev.block_hashes)
        else:
            self.drop_worker(ev.worker_id)
            self._last_seq[ev.worker_id] = ev.seq

    def _tiers_changed(self) -> None:
        if self.mirror is not None:
            self.mirror.set_tiers_present(len(self.tiers) > 0)

    def attach(self, mirror: Mirror) -> None:
        """Keep ``mirror`` a copy of this index from now on (what it holds now replayed,
        least recently used first)."""
        for h, workers in self._holders.items():
            for w in workers:
                mirror.kv_stored(w, (h,))
        mirror.set_tiers_present(len(self.tiers) > 0)
        self.mirror = mirror

    def load_snapshot(self, worker_id: str, seq: int, hashes: Sequence[int]) -> None:
        """The worker holds exactly ``hashes`` as of its KV event ``seq``; the events after
        ``seq`` follow."""
        self.drop_worker(worker_id)
        self.stored(worker_id, hashes)
        self._last_seq[worker_id] = seq

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
