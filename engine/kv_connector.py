"""The engine's side of KV transfer: how a decode engine pulls remote blocks.

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

On success the connector has also released the prefill side's lease.
"""

from __future__ import annotations

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
