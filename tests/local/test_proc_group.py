"""The one process-group helper (local/proc_group.py): stops reach the whole group, a
process that ignores the polite signal is killed after its grace, and poll_until
returns the first true value or names what it waited for."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from pdserve.local.proc_group import end_group, poll_until, signal_group

pytestmark = pytest.mark.unit

# A leader that ignores SIGTERM (its child inherits that) and prints its child's pid.
STUBBORN = 'trap "" TERM; sleep 60 & echo $!; wait'


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def _start(script: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        ["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_stubborn_group_is_killed_after_its_grace() -> None:
    proc, child = _start(STUBBORN)
    start = time.monotonic()
    assert end_group(proc, grace_s=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - start < 10
    poll_until(lambda: not _alive(child), 5, 0.05, what="the child's death")


def test_a_polite_group_ends_on_the_first_signal() -> None:
    proc, child = _start("sleep 60 & echo $!; wait")
    assert end_group(proc, signal.SIGTERM, grace_s=10) == -signal.SIGTERM
    poll_until(lambda: not _alive(child), 5, 0.05, what="the child's death")


def test_signalling_a_group_that_is_gone_is_not_an_error() -> None:
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    signal_group(proc, signal.SIGKILL)
    assert end_group(proc) == 0


def test_poll_until_returns_the_value_or_names_what_it_waited_for() -> None:
    values = iter([0, None, "ready"])
    assert poll_until(lambda: next(values), 5, 0.01) == "ready"
    with pytest.raises(TimeoutError, match=r"the moon: not within 0\.05s"):
        poll_until(lambda: False, 0.05, 0.01, what="the moon")
    with pytest.raises(TimeoutError, match="last seen: 3"):
        poll_until(lambda: False, 0.05, 0.01, what=lambda: "last seen: 3")
