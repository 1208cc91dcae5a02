"""A tier below the KV pool: blocks as bytes, by key.

Keys are ``namespace + block hash`` (``codec.block_key``): the block hash is the pool's own
keyed, per-tenant, per-adapter hash (pdserve/protocol/hashing.py), so a tier can only hand a
block to a request whose prompt hashes to it, and the namespace keeps two models (or two KV
layouts) that share a store apart.

Who calls what: the ``TieredStore`` (store.py) calls ``put`` from its writer thread and
``get`` from its loader threads; the engine thread calls only ``contains`` of a tier whose
``local`` is true (an in-memory index, no I/O). Every method is thread-safe. A tier's
failure is an exception (``TierError`` or the client's own): the store counts it and treats
the block as missing, so a tier never fails a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable


class TierError(Exception):
    """A tier could not do what was asked (the store counts it; the block is recomputed)."""


# ("removed", keys) when a bounded tier drops entries to make room (its KV events)
EvictListener = Callable[[list[bytes]], None]


class Tier(ABC):
    name: str = ""  # "host" | "disk" | "shared": what KV events and metrics call it
    local: bool = True  # ``contains`` is an in-memory lookup, cheap on the engine thread

    def __init__(self) -> None:
        self.on_evict: EvictListener | None = None

    @abstractmethod
    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` (replacing any); False when it was not kept (too large)."""

    @abstractmethod
    def get(self, key: bytes) -> bytes | None:
        """The value stored under ``key``, or None."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``get`` would (probably) find ``key``."""

    @abstractmethod
    def delete(self, key: bytes) -> None:
        """Forget ``key`` (a corrupt entry); no error when absent."""

    def close(self) -> None:  # noqa: B027 (most tiers hold nothing to release)
        """Release connections and files (the store's ``close``)."""

    def _evicted(self, keys: list[bytes]) -> None:
        if keys and self.on_evict is not None:
            self.on_evict(keys)
