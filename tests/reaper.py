"""Stops what a pytest process left running once that process is gone.

tests/conftest.py starts one per pytest process (``python tests/reaper.py PID``, stdin a
pipe from it, in a session of its own) and names the process in the environment every
service it starts inherits (``PDSERVE_TEST_OWNER=PID``). Services run in sessions of their
own, so a pytest process that ends without its fixtures' teardown (killed, an xdist worker
crashed or cut off, a Ctrl-C to its controller alone) would leave them running, holding
ports and cores. When the pipe closes (the pytest process exited, however), every process
whose environment names it gets SIGKILL: whole trees, as children inherit the variable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

OWNER = "PDSERVE_TEST_OWNER"


def owned_by(owner: int) -> list[int]:
    """The pids whose environment (as they were started) has ``PDSERVE_TEST_OWNER=owner``."""
    mark = f"{OWNER}={owner}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def main() -> None:
    owner = int(sys.argv[1])
    sys.stdin.buffer.read()  # EOF: the pytest process has exited
    for pid in owned_by(owner):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
