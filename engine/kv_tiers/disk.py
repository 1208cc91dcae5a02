"""The local-disk tier: one file per block under a directory, size-bounded.

Files are named by the key's hex digits. A write goes to a temporary file that is renamed
into place, so a reader sees a whole entry or none (a crash leaves only ``*.tmp`` files,
removed at start); the codec's checksum catches what the disk garbles later. Every file is
opened relative to the directory's descriptor with ``O_NOFOLLOW``: a symlink planted in the
directory is never followed, for reading or writing. The index (key → size, least recently
used first) lives in memory and is rebuilt from the directory at start, oldest files first;
beyond ``capacity_bytes`` the least recently used files are deleted (and reported
``removed``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

from pdserve.engine.kv_tiers.base import Tier

SUFFIX = ".kv"
_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class DiskTier(Tier):
    name = "disk"
    local = True

    def __init__(self, path: str, capacity_bytes: int) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be positive, got {capacity_bytes}")
        self.path = Path(path)
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._dir = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._seq = 0
        self._rebuild()

    def _rebuild(self) -> None:
        found = []
        for entry in os.scandir(self._dir):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.name, dir_fd=self._dir)
            elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                except ValueError:
                    continue
                st = entry.stat(follow_symlinks=False)
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.used_bytes += size
        self._trim()

    def put(self, key: bytes, value: bytes) -> bool:
        if len(value) > self.capacity_bytes:
            return False
        name = key.hex() + SUFFIX
        with self._lock:
            self._seq += 1
            tmp = f"{name}.{os.getpid()}.{self._seq}.tmp"
        fd = os.open(tmp, _WRITE, 0o600, dir_fd=self._dir)
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(value)
            os.replace(tmp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir)
            raise
        with self._lock:
            self.used_bytes += len(value) - self._index.pop(key, 0)
            self._index[key] = len(value)
            gone = self._trim()
        self._evicted(gone)
        return True

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        try:
            fd = os.open(key.hex() + SUFFIX, _READ, dir_fd=self._dir)
        except FileNotFoundError:
            self.delete(key)
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def delete(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is None:
                return
            self.used_bytes -= size
            self._unlink(key)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        os.close(self._dir)

    def _trim(self) -> list[bytes]:
        """Delete least recently used files until within capacity (lock held)."""
        gone = []
        while self.used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self._unlink(key)
            gone.append(key)
        return gone

    def _unlink(self, key: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(key.hex() + SUFFIX, dir_fd=self._dir)
