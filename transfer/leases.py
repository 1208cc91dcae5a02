"""The prefill side's leases on handed-off KV blocks: the one lease clock (monotonic).

A lease starts when the engine hands a request off (``add``) and ends exactly once:

    add ──▶ HELD ──claim(nonce, agent)──▶ CLAIMED ──done(ok or not)──▶ ended
             │ ttl passes                   │ ttl passes (from the claim)
             ▼                              ▼
           ended (expired)                ended (expired)
    end(request_id) (abort, HTTP release) ends a lease in any state.

A lease is claimed at most once (the handle's nonce is single-use): a replayed handle is
refused. ``done`` answers ``intact`` only if the lease was claimed by the same agent and
had not ended by then, which tells the decode side that the blocks it read were never
freed while it read them. Ended leases queue their blocks for ``ended()``, drained by
whoever frees blocks (the engine thread in a worker). Thread-safe: claims and dones
arrive on the side-channel thread, adds and drains on the engine thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Lease:
    request_id: str
    nonce: str
    block_ids: list[int]
    deadline: float  # monotonic
    claimed_by: str = ""


class LeaseTable:
    def __init__(
        self,
        ttl_s: float,
        on_expired: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert ttl_s > 0
        self.ttl_s = ttl_s
        self.on_expired = on_expired
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._used: OrderedDict[str, str] = OrderedDict()  # recent ended leases: nonce → why
        self._ended: queue.SimpleQueue[tuple[str, list[int]]] = queue.SimpleQueue()

    def add(self, request_id: str, nonce: str, block_ids: list[int], ttl_s: float) -> None:
        with self._lock:
            assert request_id not in self._leases, f"lease {request_id} exists"
            deadline = self.clock() + ttl_s
            self._leases[request_id] = Lease(request_id, nonce, list(block_ids), deadline)

    def claim(self, request_id: str, nonce: str, agent: str) -> str:
        """ "" if ``agent`` now holds the lease, else why not."""
        with self._lock:
            lease = self._live(request_id)
            if lease is None and nonce in self._used:
                return f"lease {request_id!r} {self._used[nonce]}"
            if lease is None or lease.nonce != nonce:
                return f"no lease {request_id!r} to claim (expired, ended or never made)"
            if lease.claimed_by:
                return f"lease {request_id!r} was already claimed (a kv handle is single-use)"
            lease.claimed_by = agent
            lease.deadline = self.clock() + self.ttl_s
            return ""

    def done(self, request_id: str, nonce: str, agent: str, ok: bool) -> bool:
        """End a claimed lease; True if it held the blocks from the claim until now."""
        with self._lock:
            lease = self._live(request_id)
            if lease is None or lease.nonce != nonce or lease.claimed_by != agent:
                return False
            self._end(lease)
            return ok

    def claimed_blocks(self, request_id: str, nonce: str, agent: str) -> list[int] | None:
        """The blocks of a live lease claimed by ``agent`` (what a tcp read may fetch)."""
        with self._lock:
            lease = self._live(request_id)
            if lease is None or lease.nonce != nonce or lease.claimed_by != agent:
                return None
            return lease.block_ids

    def end(self, request_id: str) -> bool:
        """End a lease now, whatever its state (abort, HTTP release)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                self._end(lease)
            return lease is not None

    def ended(self) -> list[tuple[str, list[int]]]:
        """Leases ended since the last call (expiring overdue ones first): their blocks
        are free to reuse."""
        self.expire()
        out = []
        while True:
            try:
                out.append(self._ended.get_nowait())
            except queue.Empty:
                return out

    def wait_ended(self, timeout: float) -> tuple[str, list[int]] | None:
        """Block up to ``timeout`` s for the next ended lease (tests, tools)."""
        end = time.monotonic() + timeout
        while True:
            self.expire()
            try:
                return self._ended.get(timeout=min(0.02, max(end - time.monotonic(), 0)))
            except queue.Empty:
                if time.monotonic() >= end:
                    return None

    def expire(self) -> None:
        with self._lock:
            now = self.clock()
            for lease in [ls for ls in self._leases.values() if ls.deadline <= now]:
                self._expire(lease)

    def held_ids(self) -> set[str]:
        with self._lock:
            return set(self._leases)

    def _live(self, request_id: str) -> Lease | None:
        lease = self._leases.get(request_id)
        if lease is not None and lease.deadline <= self.clock():
            self._expire(lease)
            return None
        return lease

    def _expire(self, lease: Lease) -> None:
        self._end(lease, "expired (the prefill side freed its blocks)")
        if self.on_expired is not None:
            self.on_expired(lease.request_id)

    def _end(self, lease: Lease, why: str = "already ended (a kv handle is single-use)") -> None:
        del self._leases[lease.request_id]
        self._used[lease.nonce] = why  # bounded: only for a clearer refusal
        if len(self._used) > 10_000:
            self._used.popitem(last=False)
        self._ended.put((lease.request_id, lease.block_ids))
