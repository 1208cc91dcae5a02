"""The service under test of bench/chaos.py: ``pdserve up`` as a user runs it.

Started as a subprocess (its own process group), read for its "ready at" lines,
stopped with SIGTERM as Ctrl-C would; ``kill9`` kills one worker the way an OOM
killer or a failed node does.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve import env
from pdserve.local.proc_group import end_group, signal_group
from pdserve.signed_httpx import SignedAuth
from pdserve.testing.up import Up, start_up

ROOT = Path(__file__).resolve().parent.parent
# The service secret of the deployment under test: the environment's, else one for this run
# (given to `pdserve up`, sent with every internal request the bench makes to a worker).
SECRET = os.environ.get(env.SERVICE_SECRET) or secrets.token_hex(16)
AUTH = SignedAuth(SECRET)  # the workers' internal API takes signed calls only


class Service:
    """``pdserve up`` with the bench's service secret (pdserve.testing.up), started on
    ``start`` and stopped (SIGTERM, as Ctrl-C) on ``stop``."""

    def __init__(self, model: str, log_dir: str, port: int, port_base: int, *extra: str) -> None:
        self.model = model
        self.flags = ["--port", str(port), "--worker-port-base", str(port_base)]
        self.flags += ["--log-dir", log_dir, *extra]
        self.up: Up | None = None

    def start(self, timeout: float = 300.0) -> None:
        environ = {**os.environ, env.SERVICE_SECRET: SECRET}
        self.up = start_up(self.model, *self.flags, timeout=timeout, env=environ)

    @property
    def url(self) -> str:
        return self.up.url if self.up is not None else ""

    @property
    def workers(self) -> dict[str, str]:
        """Worker name -> URL."""
        return self.up.named if self.up is not None else {}

    def urls(self, role: str) -> list[str]:
        return self.up.urls(role) if self.up is not None else []

    def stop(self) -> int:
        """SIGTERM (as Ctrl-C); returns up's exit code (-9 if it had to be killed)."""
        if self.up is None:
            return 0
        return end_group(self.up.proc, grace_s=60)

    @property
    def running(self) -> bool:
        return self.up is not None and self.up.proc.poll() is None


def stats(url: str) -> dict[str, Any] | None:
    try:
        return dict(httpx.get(url + "/stats", timeout=5, auth=AUTH).json())
    except (httpx.HTTPError, ValueError):
        return None


def busiest(
    urls: list[str], counts: tuple[str, ...] = ("running", "waiting", "held")
) -> tuple[str, dict[str, Any]] | None:
    """The worker with the most requests on it: by default running, waiting, or KV under
    a lease; ``counts`` names which of those count."""
    best = None
    for url in urls:
        s = stats(url)
        if s is None:
            continue
        load = sum(s.get(field, 0) for field in counts)
        if load and (best is None or load > best[0]):
            best = (load, url, s)
    return None if best is None else (best[1], best[2])


def kill9(url: str) -> bool:
    s = stats(url)
    if s is None:
        return False
    os.kill(int(s["pid"]), signal.SIGKILL)
    return True


def stop_group(url: str) -> tuple[int, int]:
    """SIGSTOP the worker at ``url`` whole, as a frozen VM or a stuck host would be: its
    process group and its engine core (forked by the core zygote, outside that group);
    (process group id, core pid), zeros if it did not answer. Nothing closes: only its
    failing health check tells the router."""
    s = stats(url)
    if s is None:
        return 0, 0
    pgid, core = os.getpgid(int(s["pid"])), int(s.get("core_pid", 0))
    signal_group(pgid, signal.SIGSTOP)
    if core and os.getpgid(core) != pgid:
        os.kill(core, signal.SIGSTOP)
    return pgid, core


def resume_group(frozen: tuple[int, int]) -> None:
    pgid, core = frozen
    if pgid:
        signal_group(pgid, signal.SIGCONT)
    if core:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)


def counter(url: str, name: str) -> float:
    """A Prometheus counter's value on ``url``/metrics (0 when absent)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_all_healthy(svc: Service, timeout: float) -> bool:
    """Every worker healthy in the router's view (killed ones restarted by up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            listed = httpx.get(svc.url + "/workers", timeout=5).json()["workers"]
            if sum(1 for w in listed if w["healthy"]) == len(svc.workers):
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    return False


def leaked_blocks(svc: Service, timeout: float) -> tuple[int, int]:
    """(KV blocks still owned after ``timeout`` s of quiet, workers that answered)."""
    deadline = time.monotonic() + timeout
    while True:
        all_stats = [s for s in (stats(u) for u in svc.workers.values()) if s is not None]
        leaked = sum(s["kv_blocks_total"] - s["kv_blocks_free"] for s in all_stats)
        if leaked == 0 or time.monotonic() > deadline:
            return leaked, len(all_stats)
        time.sleep(0.25)
