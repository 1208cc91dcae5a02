"""CPU seconds from /proc: a process, one of its threads, or a whole process tree."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")  # /proc/*/stat times are in these


def cpu_seconds(pid: int, tid: int | None = None, proc: str = "/proc") -> float:
    """utime + stime of a process (all its threads), or of one of its threads (fields 14
    and 15 of stat(5); the command name may hold spaces and parentheses, so split after the
    last ``)``)."""
    path = f"{proc}/{pid}/stat" if tid is None else f"{proc}/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, from every thread's ``children`` list (a child
    started by another thread is listed there, not under the main thread)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):  # ended while listed
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every live process under it."""
    total = 0.0
    for p in descendants(pid):
        with contextlib.suppress(OSError):  # ended between the listing and the read
            total += cpu_seconds(p)
    return total


def thread_cpu_seconds(pid: int, proc: str = "/proc") -> dict[str, float]:
    """CPU seconds of ``pid``'s live threads summed by name (``comm``, its digits dropped, so
    a pool's threads count as one; the main thread is ``main``: threads a Python process
    starts inherit its name): where a process's CPU goes, thread by thread."""
    out: dict[str, float] = {}
    for task in Path(f"{proc}/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # ended while listed
            comm = (task / "comm").read_text().strip().rstrip("0123456789_-") or "?"
            name = "main" if task.name == str(pid) else comm
            out[name] = out.get(name, 0.0) + cpu_seconds(pid, int(task.name), proc)
    return out
