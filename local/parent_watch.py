"""A process ``pdserve up`` started ends when ``pdserve up`` is gone, however it went.

``pdserve up`` stops its router and workers itself on Ctrl-C or SIGTERM; killed hard
(SIGKILL, the OOM killer, a crash) it could not, and they went on holding their ports and
memory, so the next ``pdserve up`` found its ports taken. ``LocalCluster`` therefore names
itself in ``PDSERVE_PARENT_PID`` when it starts one; ``pdserve``'s entry point (cli.py)
then watches the parent: when it is no longer this process's parent, the process is sent
SIGTERM (its own clean shutdown: a worker's core goes with it), and SIGKILL after a grace.

A thread that polls ``getppid()``, not ``PR_SET_PDEATHSIG``: that signal fires when the
parent *thread* that forked exits, and a cluster may add workers from any thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from pdserve import env

log = logging.getLogger(__name__)
POLL_S = 0.5
GRACE_S = 10.0  # after SIGTERM, before SIGKILL


def watch_from_env() -> threading.Thread | None:
    """Start the watch when ``PDSERVE_PARENT_PID`` names the parent (and take the variable
    out of the environment: it names this process's parent, not its children's)."""
    value = os.environ.pop(env.PARENT_PID, "")
    if not value.isdigit():
        return None
    thread = threading.Thread(
        target=_watch, args=(int(value),), name="pdserve-parent-watch", daemon=True
    )
    thread.start()
    return thread


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    log.warning("parent process %d is gone: shutting down", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    log.warning("still running %.0f s after SIGTERM: SIGKILL", GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
