"""Helpers shared by the tests that run real services on loopback."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pdserve.env import SERVICE_SECRET
from pdserve.local.proc_group import poll_until
from pdserve.signed_httpx import SignedAuth

ROOT = Path(__file__).resolve().parent.parent


def secret_auth() -> SignedAuth:
    """Signs calls to the workers' internal API with the service secret every process
    started by the tests shares (tests/conftest.py)."""
    return SignedAuth(os.environ[SERVICE_SECRET])


def worker_port_base() -> int:
    """A random base for a local cluster's worker ports (each cluster takes up to ~200 from
    it), in a range of its own per xdist worker, so that two workers of one run never pick
    the same ports between a check and a bind; all below Linux's ephemeral ports (32768+),
    where clients and UCX take theirs. Within a worker, LocalCluster skips ports in use."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    index = int(worker) % count if worker.isdigit() else 0
    span = 22_000 // count
    low = 10_000 + index * span
    return random.randrange(low, low + span - 200, 200)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def run_bench(script: str, *args: str, timeout: float) -> dict[str, Any]:
    """``python bench/SCRIPT ARGS`` from the repository root: it must exit 0; returns the
    JSON of its last stdout line (every benchmark prints its result there)."""
    out = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def wait_until_up(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[str, list[str]]:
    """Read ``pdserve up``'s output until its banner: the router URL (no /v1) and the
    worker URLs it printed; fails the test with the output if it exits or is too slow."""
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while not any(line.startswith("pdserve is up") for line in lines):
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "pdserve up exited:\n" + "".join(lines)
        lines.append(line)
        assert time.monotonic() < deadline, "pdserve up not ready:\n" + "".join(lines)
    text = "".join(lines)
    workers = re.findall(r"(?:prefill|decode)-\d+\s+ready at (\S+)", text)
    url = re.search(r"pdserve is up: (\S+)/v1", text).group(1)  # type: ignore[union-attr]
    return url, workers
