"""Per-client budgets shared by a replica's ``--procs`` processes (issue 44 item 6).

A connection reaches one of the processes (``SO_REUSEPORT``), so a client's requests
land on any of them. Splitting a budget across the processes rounds up (a cap of 1 over 4
processes allowed 4) and gives a keep-alive client, pinned to one process, 1/N of it. So
the processes share one table instead: anonymous ``MAP_SHARED`` memory and a lock made by
the parent before it forks (``install``, router/procs.py), one slot per client holding its
requests in flight or waiting (``--max-concurrency-per-key``) and its two token buckets
(``--rate-limit-rpm/-tpm``). Every check-and-take happens under the lock, so the
configured budget is the cap of the whole replica (replicas still split it:
router/discovery/replicas.py).

A slot's key is an 8-byte BLAKE2b of the client. Slots are found by linear probing over
``PROBE`` places and never emptied; an idle slot (nothing in flight, both buckets full
again) is taken over by a new client. When every place a client may use is busy the
request is refused (429), never let through unlimited. A process that dies takes its
siblings down (router/procs.py), so no count outlives its process in a serving replica.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import multiprocessing as mp
import struct
import time
from collections.abc import Callable

from pdserve.router.bucket import Bucket
from pdserve.router.errors import APIError, retry_later

SLOTS = 1 << 16  # clients remembered at once (3.7 MB)
PROBE = 64  # places a client may take, from its hash on
# key, in flight + waiting, requests bucket (level, stamp), tokens bucket (level, stamp),
# when both buckets are full again
_SLOT = struct.Struct("=Qqddddd")
REQUESTS, TOKENS = 0, 1


def _key(client: str) -> int:
    return int.from_bytes(hashlib.blake2b(client.encode(), digest_size=8).digest(), "little") or 1


def table_full() -> APIError:
    return retry_later(
        429, "too many clients are active at this router; retry later", "rate_limit_exceeded"
    )


class SharedLimits:
    """The table; made before ``fork`` (its memory and lock are inherited)."""

    def __init__(self, slots: int = SLOTS, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.clock = clock
        self._mem = mmap.mmap(-1, slots * _SLOT.size)  # anonymous, MAP_SHARED
        self._lock = mp.get_context("fork").Lock()

    def _find(self, key: int, now: float) -> int:
        """The offset of ``key``'s slot, taken (fresh) if it has none; lock held."""
        start, reuse = key % self.slots, -1
        for i in range(PROBE):
            off = ((start + i) % self.slots) * _SLOT.size
            k, count, *_, full_at = _SLOT.unpack_from(self._mem, off)
            if k == key:
                return off
            if k == 0:  # slots are never emptied: the key is not further on
                reuse = off if reuse < 0 else reuse
                break
            if reuse < 0 and count <= 0 and now >= full_at:
                reuse = off
        if reuse < 0:
            raise table_full()
        _SLOT.pack_into(self._mem, reuse, key, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return reuse

    def enter(self, client: str, cap: int) -> bool:
        """Count one more request of ``client`` if it has fewer than ``cap`` (0: no cap)."""
        key = _key(client)
        with self._lock:
            off = self._find(key, self.clock())
            count = _SLOT.unpack_from(self._mem, off)[1]
            if cap and count >= cap:
                return False
            struct.pack_into("=q", self._mem, off + 8, count + 1)
            return True

    def leave(self, client: str) -> None:
        key = _key(client)
        with self._lock:
            off = self._find(key, self.clock())
            count = _SLOT.unpack_from(self._mem, off)[1]
            struct.pack_into("=q", self._mem, off + 8, max(count - 1, 0))

    def count(self, client: str) -> int:
        with self._lock:
            return int(_SLOT.unpack_from(self._mem, self._find(_key(client), self.clock()))[1])

    def take(self, client: str, kind: int, capacity: float, n: float, now: float) -> float:
        """Take ``n`` from ``client``'s bucket ``kind`` (``REQUESTS``/``TOKENS``) of
        ``capacity`` a minute: 0.0, or the seconds until there will be enough (then
        nothing is taken). The rules are the local bucket's (router/ratelimit.py)."""
        key = _key(client)
        with self._lock:
            off = self._find(key, now)
            fields = list(_SLOT.unpack_from(self._mem, off))
            level, stamp = fields[2 + 2 * kind], fields[3 + 2 * kind]
            fresh = stamp == 0.0
            bucket = Bucket(capacity, capacity if fresh else level, now if fresh else stamp)
            wait = bucket.take(n, now)
            fields[2 + 2 * kind], fields[3 + 2 * kind] = bucket.level, bucket.stamp
            full = bucket.stamp + (capacity - bucket.level) * 60.0 / capacity
            fields[6] = max(fields[6], full if math.isfinite(full) else now + 60.0)
            _SLOT.pack_into(self._mem, off, *fields)
            return wait

    def give(self, client: str, kind: int, capacity: float, n: float, now: float) -> None:
        """``n`` taken from ``client``'s bucket ``kind`` and not used, back."""
        key = _key(client)
        with self._lock:
            off = self._find(key, now)
            fields = list(_SLOT.unpack_from(self._mem, off))
            level, stamp = fields[2 + 2 * kind], fields[3 + 2 * kind]
            if stamp == 0.0:  # never used: full already
                return
            bucket = Bucket(capacity, level, stamp)
            bucket.give(n, now)
            fields[2 + 2 * kind], fields[3 + 2 * kind] = bucket.level, bucket.stamp
            _SLOT.pack_into(self._mem, off, *fields)

    def start_empty(self, client: str, kind: int, now: float) -> None:
        """``client``'s bucket ``kind`` starts empty at ``now`` if it was never used."""
        key = _key(client)
        with self._lock:
            off = self._find(key, now)
            fields = list(_SLOT.unpack_from(self._mem, off))
            if fields[3 + 2 * kind] == 0.0:
                fields[2 + 2 * kind], fields[3 + 2 * kind] = 0.0, now
                fields[6] = max(fields[6], now + 60.0)
                _SLOT.pack_into(self._mem, off, *fields)


_TABLE: SharedLimits | None = None


def install() -> SharedLimits:
    """Make the table for the processes about to be forked (router/procs.py)."""
    global _TABLE
    _TABLE = SharedLimits()
    return _TABLE


def installed() -> SharedLimits | None:
    """The table this process inherited; None outside ``--procs N`` (N > 1)."""
    return _TABLE
