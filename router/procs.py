"""``pdserve router --procs N``: N router processes on one port.

Each process is a whole router (its own discovery, KV-event subscription and prefix index,
so every process has the full view) and binds the API port (and the admin port) with
``SO_REUSEPORT``: the kernel spreads incoming connections over them. The parent binds one
loopback socket per process before starting them, for the process's own /metrics page;
a scrape of /metrics on any process returns every process's series (router/metrics_merge.py).

The parent only supervises: SIGTERM/SIGINT go to every process; when one process exits, the
others are stopped and the parent exits with its status, so the pod restarts as a whole
rather than serving on with part of its capacity and a port some connections fail on.
Per-client budgets (rate limits, per-key concurrency) are the replica's whole: the parent
makes one table of counters and buckets before it forks, which every process shares
(router/shared_limits.py); the slots (``--max-queue``, ``--max-waiting``) are split.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from pdserve.router import shared_limits

STOP_GRACE_S = 30.0  # a process gets this long to drain before SIGKILL


AUTO_PROCS_UNLIMITED = 4  # 'auto' without a CPU limit (a node's whole CPU count is too many)


def cpu_limit() -> int:
    """``--procs auto``: the cgroup's CPU quota (a pod's CPU limit) when it has one, else
    the CPUs this process may run on, at most ``AUTO_PROCS_UNLIMITED``; at least 1."""
    cpus = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            return max(1, min(cpus, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, min(cpus, AUTO_PROCS_UNLIMITED))


def metrics_sockets(n: int) -> list[socket.socket]:
    """One bound loopback socket per process, for its own /metrics page."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        s.set_inheritable(True)
        socks.append(s)
    return socks


def supervise(args: argparse.Namespace, n: int, child: Callable[..., int]) -> int:
    """Start ``child(args, index, sockets)`` in ``n`` forked processes; wait; stop all."""
    socks = metrics_sockets(n)
    shared_limits.install()  # before the fork: every process inherits the same table
    ctx = mp.get_context("fork")  # nothing has started threads yet: the app is built per child
    procs: list[BaseProcess] = [
        ctx.Process(target=_run_child, args=(child, args, i, socks), name=f"router-{i}")
        for i in range(n)
    ]
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signum)

    # before the first start: a SIGTERM meanwhile must not kill the parent alone
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for p in procs:
        p.start()
    for s in socks:
        s.close()
    status, deadline = 0, None
    while not all(p.exitcode is not None for p in procs):
        exited = [p for p in procs if p.exitcode is not None]
        if exited and not stopping:  # one process died on its own: stop the others
            status = exited[0].exitcode or 1
            stop(signal.SIGTERM, None)
        if stopping and deadline is None:
            deadline = time.monotonic() + STOP_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                p.kill()
        time.sleep(0.1)
    return abs(status)


def _run_child(
    child: Callable[..., int], args: argparse.Namespace, index: int, socks: list[socket.socket]
) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise SystemExit(child(args, index, socks))
