"""Process groups and waits: the one place that signals, stops and polls them.

``pdserve up``, the tests and the benches start each service in a session of its own
(``start_new_session=True``), so one signal to its group reaches the children it started
too (a worker's engine core, ``pdserve up``'s workers). Signalling a group that is gone
is not an error: a stop races with the process's own exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def start_group(
    argv: list[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.Popen[str]:
    """``argv`` in a session (and process group) of its own, its stdout and stderr merged
    into one text pipe for the caller to read (``end_group`` stops the whole group)."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
        cwd=cwd,
        preexec_fn=preexec_fn,
    )


def signal_group(proc: subprocess.Popen[Any] | int, sig: int) -> None:
    """``sig`` to the process group led by ``proc`` (a Popen or a pid)."""
    pid = proc if isinstance(proc, int) else proc.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def end_group(
    proc: subprocess.Popen[Any],
    sig: int = signal.SIGTERM,
    grace_s: float = 30.0,
    whole: bool = True,
) -> int:
    """Stop ``proc``: ``sig`` to its group (to the leader alone unless ``whole``: a process
    that stops its own children), up to ``grace_s`` for it to exit, then SIGKILL to the
    whole group. Returns its exit code (negative: the signal that ended it)."""
    if proc.poll() is None:
        if whole:
            signal_group(proc, sig)
        else:
            proc.send_signal(sig)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        return proc.wait(10)


def poll_until(
    check: Callable[[], T],
    timeout: float,
    interval: float = 0.2,
    what: str | Callable[[], str] = "the condition",
) -> T:
    """Call ``check`` every ``interval`` seconds until it returns something true, and return
    that; after ``timeout`` seconds raise TimeoutError naming ``what`` (a callable: built
    then, so it can show the last state seen). ``check`` may itself raise (an assert on a
    process that died) to stop early."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            name = what() if callable(what) else what
            raise TimeoutError(f"{name}: not within {timeout:g}s")
        time.sleep(interval)
