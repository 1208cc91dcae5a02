"""The engine's side of KV transfer: two halves, one per worker role.

``KVHolder`` (prefill): owns the blocks of handed-off requests, their lease and its
release; ``KVConnector`` (decode): pulls remote blocks. The engine owns blocks and
request state; the halves own the wire. Implementations: ``transfer/server.py``
(``KVServer``, prefill) and ``transfer/connector.py`` (``RemoteKVConnector``, decode).

Decode half.

The engine owns blocks and request state; a connector owns the wire. The engine
calls a connector from its step thread only:

* ``start_load`` once per request that arrives with a remote KV handle, after
  local blocks were allocated for it. It must not block: it starts one transfer
  covering all the request's blocks and returns.
* ``poll`` once per engine step. It returns the loads that finished since the
  last call (successfully or not). A load that fails or runs past its timeout is
  reported with ``ok=False``; the engine then recomputes the prompt locally (or
  fails the request), never uses the half-written blocks.
* ``cancel`` when a request waiting for its KV is aborted. The connector stops
  caring about the transfer; the engine frees the blocks only after ``poll``
  reports the cancelled load (so no transfer writes into a reused block).

On success the connector has also ended the prefill side's lease, and the prefill side
confirmed the blocks stayed held for the whole read (only then ``ok``).
A load whose read could not be stopped is reported with ``quarantined``: its local blocks
must stay out of use until ``unquarantined`` names the request (the transport reported the
read ended), or the process restarts.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    ok: bool
    error: str = ""
    num_bytes: int = 0
    seconds: float = 0.0
    quarantined: bool = False  # the read may still write the local blocks: do not reuse


class KVConnector(ABC):
    @abstractmethod
    def start_load(
        self,
        request_id: str,
        handle: Any,
        remote_block_ids: list[int],
        local_block_ids: list[int],
    ) -> None:
        """Start reading ``remote_block_ids`` of ``handle`` into ``local_block_ids``.

        The two lists have equal length. ``handle`` is a
        :class:`pdserve.transfer.messages.KVHandle`; the remote ids are a suffix
        of ``handle.block_ids`` (blocks the decode side already caches are not read).
        """

    @abstractmethod
    def poll(self) -> list[LoadResult]:
        """Loads finished (or failed, or cancelled) since the last call."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Give up on a load; it is still reported by ``poll`` once it has stopped."""

    def unquarantined(self) -> list[str]:
        """Requests whose quarantined blocks are safe to reuse now (engine thread, each step)."""
        return []


class KVHolder(ABC):
    """Prefill half: owns the blocks of each handed-off request until its hold ends.

    The engine gives up the blocks in ``hold`` and takes them back from ``freed``; in
    between only the holder decides when they are free (the decode side is done, the
    lease timed out, or ``release``)."""

    @abstractmethod
    def hold(
        self, request_id: str, block_ids: list[int], num_tokens: int, block_hashes: list[int]
    ) -> Any:
        """Engine thread, once per handed-off request: take ``block_ids`` (the prompt's
        first, then any more) and return the handle sent with the first token."""

    @abstractmethod
    def release(self, request_id: str) -> bool:
        """Any thread: end the hold now (abort); False if there was none."""

    @abstractmethod
    def freed(self) -> list[list[int]]:
        """Engine thread, every step and when idle: blocks of holds that ended."""

    @abstractmethod
    def held_ids(self) -> set[str]:
        """Requests held now."""


class HeldBlocks(KVHolder):
    """The in-process holder: no handle and no lease; held until ``release`` (engine tests,
    a prefill engine without a transfer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[int]] = {}
        self._freed: queue.SimpleQueue[list[int]] = queue.SimpleQueue()

    def hold(
        self, request_id: str, block_ids: list[int], num_tokens: int, block_hashes: list[int]
    ) -> None:
        with self._lock:
            self._held[request_id] = list(block_ids)

    def release(self, request_id: str) -> bool:
        with self._lock:
            blocks = self._held.pop(request_id, None)
        if blocks is not None:
            self._freed.put(blocks)
        return blocks is not None

    def freed(self) -> list[list[int]]:
        out = []
        while not self._freed.empty():
            out.append(self._freed.get_nowait())
        return out

    def held_ids(self) -> set[str]:
        with self._lock:
            return set(self._held)
