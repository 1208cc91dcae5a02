"""A file re-read when it changes: the API key file (``api_keys.py``), the ``--budget-peers``
list (``peer_list.py``) and the workers file (``discovery/file.py``) each watch theirs with
:class:`WatchedFile`.

A change is a new (mtime, size) stamp: the size catches a rewrite within the clock's tick.
The stamp is taken before the read and kept only after a good one, so a file caught half
written (a read that raises) is read again on the next check.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")
Stamp = tuple[int, int]  # (st_mtime_ns, st_size)


class WatchedFile(Generic[T]):
    """``path`` and the ``read`` that parses it."""

    def __init__(self, path: str | Path, read: Callable[[str], T]) -> None:
        self.path, self._read = str(path), read
        self.stamp: Stamp | None = None  # of the last good read; None before the first

    def changed(self) -> T | None:
        """The file read again if its stamp moved since the last good read, else None. The
        errors of ``os.stat`` and of ``read`` (OSError, ValueError) reach the caller."""
        st = os.stat(self.path)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self.stamp:
            return None
        value = self._read(self.path)
        self.stamp = stamp
        return value
