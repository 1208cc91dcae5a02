"""Per-client rate limits: requests and tokens per minute, as token buckets.

A client is its API key (or, with no keys configured, its address). Each has two
buckets that refill continuously at limit/60 per second up to one minute's worth:
a request takes 1 from the first when it arrives and ``prompt + max_tokens``
tokens from the second once its prompt is tokenized (the worst case, as OpenAI
counts ``max_tokens`` against its limit). An empty bucket is a 429 whose
``Retry-After`` says when enough will have refilled.

With ``--procs N`` the buckets live in the table the replica's processes share
(router/shared_limits.py): the limits are the replica's, not split again per process.
Several router replicas split the limits (``split``, router/discovery/replicas.py): each
enforces ``ceil(limit / replicas)`` of a client's budget, its buckets resized at once when
the count changes (a bucket keeps its level, up to its new capacity).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.router.bucket import Bucket
from pdserve.router.discovery.replicas import share
from pdserve.router.errors import retry_later

if TYPE_CHECKING:
    from pdserve.router.shared_limits import SharedLimits

__all__ = ["Bucket", "RateLimiter"]
MAX_CLIENTS = 10_000  # buckets kept; beyond it the full (idle) ones are dropped


class RateLimiter:
    def __init__(
        self,
        rpm: int,
        tpm: int,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedLimits | None = None,
    ) -> None:
        self.rpm, self.tpm, self.clock = rpm, tpm, clock
        self.shared = shared  # --procs N: the buckets the replica's processes share
        self.base = (rpm, tpm)  # the whole budget; rpm/tpm are this replica's share
        self._buckets: dict[tuple[str, str], Bucket] = {}

    def split(self, replicas: int) -> None:
        """Enforce one of ``replicas`` equal shares of the limits from now on."""
        self.rpm, self.tpm = (share(limit, replicas) for limit in self.base)
        for (_, kind), bucket in self._buckets.items():
            bucket.capacity = float(self.rpm if kind == "requests" else self.tpm)
            bucket.level = min(bucket.level, bucket.capacity)

    def start_empty(self, client: str, now: float) -> None:
        """``client``'s buckets, where it has none yet, start empty instead of full (a key
        whose budget another replica kept until now: router/peer_budgets.py)."""
        for which, kind, limit in ((0, "requests", self.rpm), (1, "tokens", self.tpm)):
            if limit <= 0:
                continue
            if self.shared is not None:
                self.shared.start_empty(client, which, now)
            elif (client, kind) not in self._buckets:
                self._prune(now)
                self._buckets[(client, kind)] = Bucket(float(limit), 0.0, now)

    @property
    def enabled(self) -> bool:
        return self.rpm > 0 or self.tpm > 0

    def take_request(self, client: str) -> None:
        if self.rpm > 0:
            self._take(client, "requests", self.rpm, 1)

    def take_tokens(self, client: str, n: int) -> None:
        if self.tpm > 0:
            self._take(client, "tokens", self.tpm, n)

    def give_tokens(self, client: str, n: int) -> None:
        """``n`` tokens taken from ``client``'s bucket and not used, back (a lease's
        rest, router/peer_budgets.py)."""
        if self.tpm <= 0 or n <= 0:
            return
        now = self.clock()
        if self.shared is not None:
            self.shared.give(client, 1, float(self.tpm), float(n), now)
        elif (bucket := self._buckets.get((client, "tokens"))) is not None:
            bucket.give(n, now)

    def _take(self, client: str, kind: str, limit: int, n: int) -> None:
        now = self.clock()
        if self.shared is not None:
            which = 0 if kind == "requests" else 1
            wait = self.shared.take(client, which, float(limit), float(n), now)
        else:
            bucket = self._buckets.get((client, kind))
            if bucket is None:
                self._prune(now)
                bucket = self._buckets[(client, kind)] = Bucket(float(limit), float(limit), now)
            wait = bucket.take(n, now)
        if wait == 0.0:
            return
        after = math.ceil(wait)
        message = f"rate limit of {limit} {kind} per minute reached; retry in {after} s"
        raise retry_later(429, message, "rate_limit_exceeded", after)

    def _prune(self, now: float) -> None:
        if len(self._buckets) < MAX_CLIENTS:
            return
        for key, b in list(self._buckets.items()):
            if b.level + (now - b.stamp) * b.capacity / 60.0 >= b.capacity:
                del self._buckets[key]  # full again: forgetting it changes nothing
