"""The host-memory tier: a bounded LRU of entries in this process's RAM.

On a CPU worker the pool itself is host memory, so this tier is the cheaper RAM below it:
entries are kept as bytes (optionally zlib-compressed, level 1), outside the pool's
budget, up to ``capacity_bytes``; the least recently used go first (and are reported
``removed``). On a GPU node it is the host copy below the device pool. One lock guards
the map; copies and (de)compression happen outside it.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict

from pdserve.engine.kv_tiers.base import Tier


class HostTier(Tier):
    name = "host"
    local = True

    def __init__(self, capacity_bytes: int, compress: bool = False) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.compress = compress
        self.used_bytes = 0
        self.raw_bytes = 0  # before compression (the ratio the docs report)
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()

    def put(self, key: bytes, value: bytes) -> bool:
        stored = zlib.compress(value, 1) if self.compress else value
        if len(stored) > self.capacity_bytes:
            return False
        gone: list[bytes] = []
        with self._lock:
            self._pop(key)
            self._entries[key] = (stored, len(value))
            self.used_bytes += len(stored)
            self.raw_bytes += len(value)
            while self.used_bytes > self.capacity_bytes:
                old = next(iter(self._entries))
                self._pop(old)
                gone.append(old)
        self._evicted(gone)
        return True

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                return None
            self._entries.move_to_end(key)
        return zlib.decompress(item[0]) if self.compress else item[0]

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._pop(key)

    def __len__(self) -> int:
        return len(self._entries)

    def _pop(self, key: bytes) -> None:
        item = self._entries.pop(key, None)
        if item is not None:
            self.used_bytes -= len(item[0])
            self.raw_bytes -= item[1]
