"""Helpers shared by the tests that run real services on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pdserve.env import SERVICE_SECRET
from pdserve.local.proc_group import poll_until
from pdserve.signed_httpx import SignedAuth

ROOT = Path(__file__).resolve().parents[2]  # the checkout: pdserve/testing/ -> root


# A tiny model's worker on CPU: a small KV pool and batch, a short context.
SMALL_WORKER_ARGS = (
    *("--device", "cpu", "--kv-cache-bytes", "6000000"),
    *("--max-num-batched-tokens", "512", "--max-model-len", "1024"),
)


def secret_auth() -> SignedAuth:
    """Signs calls to the workers' internal API with the service secret every process
    started by the tests shares (tests/conftest.py)."""
    return SignedAuth(os.environ[SERVICE_SECRET])


# The port blocks this process reserved (open, flock-ed files), oldest first.
_RESERVED: list[int] = []
# How many reservations a process keeps: a block is needed only from its pick until its
# cluster's workers have bound it (seconds); after that LocalCluster's bind check skips it.
KEEP_RESERVED = 16


def worker_port_base() -> int:
    """A base for a local cluster's worker ports (each cluster takes up to ~200 from it),
    below Linux's ephemeral ports (32768+, where clients and UCX take theirs), reserved
    machine-wide: an exclusive flock on /tmp/pdserve-test-ports/BASE, held by this process.
    Two pytest processes (the xdist workers of one run, or two runs on one machine) never
    pick the same block, so none binds another's worker port in the seconds between
    LocalCluster's free-port check and the worker's bind (seen: 'served by pid N, not
    ours'). A process keeps its last ``KEEP_RESERVED`` blocks."""
    lock_dir = Path(tempfile.gettempdir()) / "pdserve-test-ports"
    lock_dir.mkdir(exist_ok=True)
    bases = list(range(10_000, 32_000 - 200, 200))
    random.shuffle(bases)
    for base in bases:
        fd = os.open(lock_dir / str(base), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _RESERVED.append(fd)
        while len(_RESERVED) > KEEP_RESERVED:
            os.close(_RESERVED.pop(0))  # closing the file releases its lock
        return base
    raise RuntimeError(f"every port block under {lock_dir} is reserved")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused_start(role: str, model_dir: Path, *extra: str) -> str:
    """Start ``pdserve ROLE`` on CPU with the flags ``extra``, expecting it to refuse them:
    it must exit non-zero by itself. Returns its output, stdout then stderr."""
    where = ("--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()))
    argv = [sys.executable, "-m", "pdserve", role, "--model", str(model_dir), *where, *extra]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, run.stderr[-2000:]
    return run.stdout + run.stderr


def all_kv_free(urls: list[str], timeout: float = 30.0) -> None:
    """Every worker's KV pool is free again (cancelled streams are aborted at the workers)."""
    stats: list[dict[str, Any]] = []

    def free() -> bool:
        stats[:] = [httpx.get(u + "/stats", timeout=5, auth=secret_auth()).json() for u in urls]
        return all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats)

    poll_until(free, timeout, what=lambda: f"KV freed (last: {stats})")


def sse_chunks(url: str, body: dict[str, Any], timeout: float = 120) -> Iterator[dict[str, Any]]:
    """The decoded chunks of a streamed completion at ``url``: status 200 and no error
    chunk, or the test fails."""
    with httpx.stream("POST", url, json=body, timeout=timeout) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk


async def start_router(*flags: str) -> asyncio.subprocess.Process:
    """``python -m pdserve router FLAGS`` quietly (warnings only, health checked every
    0.2 s), its stdout and stderr in one pipe."""
    quiet = ("--log-level", "warning", "--health-interval", "0.2")
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "pdserve", "router", *quiet, *flags),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def wait_healthy(h: httpx.AsyncClient, url: str, timeout: float = 60.0) -> None:
    """Until ``url``'s ``/health`` answers 200 (polled every 0.1 s), or the test fails."""
    for _ in range(int(timeout / 0.1)):
        with contextlib.suppress(httpx.HTTPError):
            if (await h.get(url + "/health")).status_code == 200:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


def run_bench(script: str, *args: str, timeout: float) -> dict[str, Any]:
    """``python bench/SCRIPT ARGS`` from the repository root: it must exit 0; returns the
    JSON of its last stdout line (every benchmark prints its result there)."""
    out = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))
