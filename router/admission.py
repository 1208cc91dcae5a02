"""Admission: the router's slots for requests in flight, shared fairly across clients.

A client is an API key (or, with no keys, an address). ``--max-queue`` slots are held by
requests in flight. When all are taken, a request waits (at most ``--queue-timeout``) in
its client's own FIFO; a freed slot goes to the waiting client of the highest priority
that was served longest ago (round robin over clients, deficit round robin with equal
costs). So a client with many waiting requests cannot starve one with a single request.

At most ``--max-waiting`` requests wait. When that is full, a newcomer takes the place of
the newest waiter of the client with the most waiters (that one gets the 429), if that
client has at least two more waiters than the newcomer's, or a lower priority; else the
newcomer is refused. ``--max-concurrency-per-key`` bounds one client's requests, in
flight and waiting together: counted in this process, or with ``--procs N`` in the table
the replica's processes share (router/shared_limits.py), so the cap is the replica's;
with several router replicas each enforces ``ceil(cap / replicas)`` of it (``split``,
router/discovery/replicas.py). The slots themselves (``--max-queue``) are this process's
own capacity.

Nothing here reads a body: requests are admitted after their body is read (under
``--body-timeout``), so a slow client never holds a slot while it trickles bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable

from pdserve.router.discovery.replicas import share
from pdserve.router.errors import APIError, retry_later
from pdserve.router.shared_limits import SharedLimits

Waiters = OrderedDict[str, deque[asyncio.Future[None]]]


def queue_full(slots: int) -> APIError:
    return retry_later(
        429,
        f"the router's queue is full ({slots} requests); retry later",
        "queue_full",
    )


class Ticket:
    """One admitted request's slot; releasing twice is harmless."""

    def __init__(self, owner: Admission, client: str) -> None:
        self._owner: Admission | None = owner
        self.client = client
        self.after: Callable[[str], None] | None = None  # a peer budget's leave

    def release(self) -> None:
        if self._owner is not None:
            self._owner._release(self.client)
            self._owner = None
            if self.after is not None:
                self.after(self.client)


class LocalCounts:
    """Each client's requests in flight or waiting, in this process alone."""

    def __init__(self) -> None:
        self._n: dict[str, int] = {}

    def enter(self, client: str, cap: int) -> bool:
        n = self._n.get(client, 0)
        if cap and n >= cap:
            return False
        self._n[client] = n + 1
        return True

    def leave(self, client: str) -> None:
        n = self._n.pop(client, 0) - 1
        if n > 0:
            self._n[client] = n

    def count(self, client: str) -> int:
        return self._n.get(client, 0)


def concurrency_limit(cap: int) -> APIError:
    return retry_later(
        429,
        f"this API key already has {cap} requests in flight or "
        "waiting (--max-concurrency-per-key); retry when one finishes",
        "concurrency_limit_exceeded",
    )


class Admission:
    def __init__(
        self,
        slots: int,
        per_client: int = 0,
        max_waiting: int = 0,
        wait_s: float = 30.0,
        on_change: Callable[[int], None] = lambda active: None,
        shared: SharedLimits | None = None,
    ) -> None:
        self.slots, self.per_client = slots, per_client
        # a client's requests in flight + waiting, counted only under a cap (its base
        # never changes, so a request is counted on its way out iff on its way in)
        self.counting = per_client > 0
        self.counts: LocalCounts | SharedLimits = shared if shared is not None else LocalCounts()
        self.base_per_client = per_client  # the whole cap; per_client is this replica's share
        self.max_waiting, self.wait_s = max_waiting, wait_s
        self.active = 0
        self.held: dict[str, int] = {}
        self._served: dict[str, int] = {}  # client -> its last grant's number (holding/waiting)
        self._grants = 0
        self._waiting: dict[int, Waiters] = {}  # priority -> client -> its waiters, in order
        self._on_change = on_change
        # --budget-peers: the key's count is taken at its owner first (router/runtime.py
        # take_request; admit hands it to the ticket), so the sync fast path is off; a
        # slot is then taken in ``acquire``.
        self.deferred = False

    def split(self, replicas: int) -> None:
        """Enforce one of ``replicas`` shares of ``--max-concurrency-per-key`` from now on
        (requests already in are kept; a client above its new share waits for them)."""
        self.per_client = share(self.base_per_client, replicas)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for level in self._waiting.values() for q in level.values())

    def waiting_of(self, client: str) -> int:
        return sum(len(level.get(client, ())) for level in self._waiting.values())

    def try_now(self, client: str) -> Ticket | None:
        """A slot for ``client`` if one is free and nobody waits, else None (then
        ``acquire``); the 429 of ``--max-concurrency-per-key`` when the client is at it."""
        return None if self.deferred else self._try_now(client)

    def _try_now(self, client: str) -> Ticket | None:
        self._enter(client)
        if self.active < self.slots and not self._waiting:
            self._take(client)
            return Ticket(self, client)
        self._leave(client)  # acquire counts it again when it waits
        return None

    def _enter(self, client: str) -> None:
        if self.counting and not self.counts.enter(client, self.per_client):
            raise concurrency_limit(self.per_client)

    def _leave(self, client: str) -> None:
        if self.counting:
            self.counts.leave(client)

    async def acquire(self, client: str, priority: int = 0) -> Ticket:
        """A slot for ``client``: at once when one is free and nobody waits, else after
        waiting its turn. Raises the 429 that says why it was refused."""
        ticket = self._try_now(client)
        if ticket is not None:
            return ticket
        if self.max_waiting < 1:
            raise queue_full(self.slots)
        self._enter(client)  # before a victim is made room for: a refused newcomer takes none
        if self.num_waiting >= self.max_waiting:
            try:
                self._make_room(client, priority)
            except APIError:
                self._leave(client)
                raise
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        level = self._waiting.setdefault(priority, OrderedDict())
        level.setdefault(client, deque()).append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.wait_s)
        except TimeoutError:
            self._forget(priority, client, fut)
            if not _granted(fut):
                raise queue_full(self.slots) from None
        except asyncio.CancelledError:  # the client went away while it waited
            self._forget(priority, client, fut)
            if _granted(fut):
                self._release(client)
            raise
        return Ticket(self, client)

    def _take(self, client: str) -> None:
        self.active += 1
        self.held[client] = self.held.get(client, 0) + 1
        self._grants += 1
        self._served[client] = self._grants
        self._on_change(self.active)

    def _release(self, client: str) -> None:
        assert self.active > 0 and self.held.get(client, 0) > 0
        self.active -= 1
        self.held[client] -= 1
        self._leave(client)
        if not self.held[client]:
            del self.held[client]
            self._drop_idle(client)
        self._on_change(self.active)
        while self.active < self.slots and self._waiting:
            self._wake_next()

    def _wake_next(self) -> None:
        """Hand a free slot to the next waiter: highest priority, then the client served
        longest ago (one never served first)."""
        priority = max(self._waiting)
        level = self._waiting[priority]
        client = min(level, key=lambda c: self._served.get(c, 0))
        queue = level[client]
        fut = queue.popleft()
        if not queue:
            del level[client]
        self._tidy(priority)
        if fut.done():  # timed out or cancelled meanwhile: nothing to hand over
            self._leave(client)
            return
        self._take(client)
        fut.set_result(None)

    def _make_room(self, client: str, priority: int) -> None:
        """Refuse the newest waiter of the client with the most waiters, if it has at least
        two more than ``client`` (or a lower priority); else refuse the newcomer."""
        own = self.waiting_of(client)
        best: tuple[int, int, str] | None = None  # (-priority, waiters, client)
        for prio, level in self._waiting.items():
            if prio > priority:
                continue
            for other, q in level.items():
                cand = (-prio, len(q), other)
                if best is None or cand[:2] > best[:2]:
                    best = cand
        if best is None or (-best[0] == priority and best[1] < own + 2):
            raise queue_full(self.slots)
        prio, victim = -best[0], best[2]
        fut = self._waiting[prio][victim].pop()
        if not self._waiting[prio][victim]:
            del self._waiting[prio][victim]
        self._tidy(prio)
        self._drop_idle(victim)
        self._leave(victim)
        fut.set_exception(queue_full(self.slots))

    def _forget(self, priority: int, client: str, fut: asyncio.Future[None]) -> None:
        level = self._waiting.get(priority)
        q = level.get(client) if level is not None else None
        if q is not None:
            with contextlib.suppress(ValueError):
                q.remove(fut)
                self._leave(client)  # it waited, never granted
            if not q:
                del self._waiting[priority][client]
            self._tidy(priority)
        if not fut.done():
            fut.cancel()
        self._drop_idle(client)

    def _drop_idle(self, client: str) -> None:
        """Forget a client that neither holds nor waits (the table stays bounded)."""
        if client not in self.held and not self.waiting_of(client):
            self._served.pop(client, None)

    def _tidy(self, priority: int) -> None:
        if priority in self._waiting and not self._waiting[priority]:
            del self._waiting[priority]


def _granted(fut: asyncio.Future[None]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is None
