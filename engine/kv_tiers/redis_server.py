"""Start a local redis-server (or valkey-server) for the shared KV tier: tests, benches and
local runs. The server is Debian's (scripts/setup.sh installs it); in a cluster the operator
runs the redis image instead (operator/render_kv_store.py).

The server listens on loopback only, keeps nothing on disk (``--save ""``, no AOF) and
bounds its memory with ``allkeys-lru``: the shared tier is a cache, what it drops is
recomputed."""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass

import redis


@dataclass
class LocalRedis:
    proc: subprocess.Popen[bytes]
    port: int
    password: str | None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, password=self.password, socket_timeout=2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def server_binary() -> str:
    path = shutil.which("redis-server") or shutil.which("valkey-server")
    if path is None:
        raise RuntimeError(
            "no redis-server or valkey-server: run scripts/setup.sh (as root "
            "it installs Debian's redis-server)"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(
    port: int | None = None,
    maxmemory: str = "256mb",
    password: str | None = None,
    timeout_s: float = 10.0,
    die_with_parent: bool = False,
) -> LocalRedis:
    """``die_with_parent``: the kernel sends the server SIGTERM when the thread that
    started it exits (``pdserve up``'s main thread: a hard kill of ``up`` leaves no
    server behind)."""
    port = port or free_port()
    args = [
        server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        maxmemory,
        "--maxmemory-policy",
        "allkeys-lru",
        "--protected-mode",
        "yes",
        "--loglevel",
        "warning",
    ]
    if password:
        args += ["--requirepass", password]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent if die_with_parent else None,
    )
    server = LocalRedis(proc, port, password)
    end = time.monotonic() + timeout_s
    while True:
        try:
            if server.client().ping():
                return server
        except redis.RedisError:
            pass
        if proc.poll() is not None or time.monotonic() > end:
            server.stop()
            raise RuntimeError(f"redis-server on port {port} did not start")
        time.sleep(0.02)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread exits (PR_SET_PDEATHSIG)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
