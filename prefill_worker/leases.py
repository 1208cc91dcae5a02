"""Leases on handed-off KV blocks: held until the decode side releases them, or expiry.

Every request the engine hands off (``engine.held``) gets a lease when the hook
first sees it, so blocks are never held without a deadline, even if the HTTP
handler that would have answered with the handle is gone. Releases arrive on
other threads (the side channel, HTTP) and are applied on the engine thread.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from pdserve.engine.llm_engine import LLMEngine


class LeaseManager:
    def __init__(self, lease_seconds: float, on_expired: Callable[[], None]) -> None:
        assert lease_seconds > 0
        self.lease_seconds = lease_seconds
        self.on_expired = on_expired
        self._deadlines: dict[str, float] = {}  # engine thread only
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()

    def release(self, request_id: str) -> None:
        """Thread-safe: the decode side has read the blocks (or gave up)."""
        self._released.put(request_id)

    def hook(self, engine: LLMEngine) -> None:
        """Engine-thread hook: apply releases, start new leases, expire old ones."""
        while True:
            try:
                rid = self._released.get_nowait()
            except queue.Empty:
                break
            self._deadlines.pop(rid, None)
            engine.release_held(rid)
        now = time.monotonic()
        for rid in engine.held:
            self._deadlines.setdefault(rid, now + self.lease_seconds)
        for rid, deadline in list(self._deadlines.items()):
            if rid not in engine.held:
                del self._deadlines[rid]  # aborted through the engine
            elif now >= deadline:
                del self._deadlines[rid]
                engine.release_held(rid)
                self.on_expired()

    @property
    def active(self) -> int:
        return len(self._deadlines)
