"""Give the calling thread its Python name at the OS level too (``/proc/<pid>/task/<tid>/comm``,
``top -H``, ``py-spy``-free tooling). Python 3.11 names only its own ``threading`` objects;
the kernel's name stays the process's. Linux only; elsewhere (or if prctl fails) a no-op."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

_PR_SET_NAME = 15  # prctl(2); the kernel keeps the first 15 bytes


def name_os_thread(name: str | None = None) -> bool:
    """Set the OS name of the calling thread (default: its ``threading`` name)."""
    if not sys.platform.startswith("linux"):
        return False
    raw = (name or threading.current_thread().name).encode()[:15]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False
