"""The closed-loop client of ``bench/router_throughput.py``: streamed completions at a fixed
number in flight, each read to its end, in this process or in processes of its own.

In its own processes (``--client-procs N``) the client does not share the router's event
loop or the bench's, and with ``--pin`` it runs on the cores that are not the router's: the
wall requests/s it measures is then the router's when the router's core is the busy one
(the bench reports the router's share of a core beside it, ``router_busy``).

As a process: ``python bench/router_client.py URL BODIES CONCURRENCY``. ``BODIES`` is a
file of request bodies, one JSON line each; the first ``CONCURRENCY`` warm the connections.
The process prints ``ready``, waits for a line on stdin, runs the rest and prints one JSON
line: its start and end (``time.monotonic``, one clock for every process of the host),
requests and errors.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp


async def one(http: aiohttp.ClientSession, url: str, payload: Any, headers: Any) -> float:
    """Seconds for one streamed call read to its end; raises on any error."""
    t0 = time.perf_counter()
    async with http.post(url, data=payload, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        async for _ in r.content.iter_any():
            pass
    return time.perf_counter() - t0


async def closed_loop(
    http: aiohttp.ClientSession, url: str, bodies: list[bytes], conc: int
) -> tuple[float, int]:
    """(wall seconds, errors) for every body at ``conc`` in flight."""
    queue = list(reversed(bodies))
    errors = 0
    hdr = {"content-type": "application/json"}

    async def worker() -> None:
        nonlocal errors
        while queue:
            try:
                await one(http, url + "/v1/completions", queue.pop(), hdr)
            except (aiohttp.ClientError, RuntimeError):
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0, errors


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)
    )


async def client_process(url: str, bodies: list[bytes], conc: int) -> dict[str, Any]:
    async with session() as http:
        await closed_loop(http, url, bodies[:conc], conc)  # connections, caches
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        t0 = time.monotonic()
        _, errors = await closed_loop(http, url, bodies[conc:], conc)
        t1 = time.monotonic()
    return {"t0": t0, "t1": t1, "requests": len(bodies) - conc, "errors": errors}


async def across_processes(
    url: str, warm: list[bytes], bodies: list[bytes], procs: int, conc: int, go: Callable[[], Any]
) -> tuple[float, int]:
    """``closed_loop`` in ``procs`` processes of this script, ``conc`` in flight in all
    (split between them), each warmed first; ``go()`` is called when every one is ready,
    just before they start: (wall seconds from the first start to the last end, errors)."""
    shares = [conc // procs + (i < conc % procs) for i in range(procs)]
    with tempfile.TemporaryDirectory() as tmp:
        kids = []
        for i, c in enumerate(shares):
            path = Path(tmp) / f"bodies-{i}"
            path.write_bytes(b"\n".join([*warm[:c], *bodies[i::procs]]) + b"\n")
            cmd = [sys.executable, __file__, url, str(path), str(c)]
            kids.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
        try:
            for kid in kids:
                line = await asyncio.to_thread(kid.stdout.readline)  # type: ignore[union-attr]
                if line.strip() != "ready":
                    raise RuntimeError(f"client process: {line!r}")
            go()
            for kid in kids:
                kid.stdin.write("go\n")  # type: ignore[union-attr]
                kid.stdin.flush()  # type: ignore[union-attr]
            outs = [
                json.loads(await asyncio.to_thread(kid.stdout.readline))  # type: ignore[union-attr]
                for kid in kids
            ]
        finally:
            for kid in kids:
                kid.kill()
                kid.wait()
    wall = max(o["t1"] for o in outs) - min(o["t0"] for o in outs)
    return wall, sum(o["errors"] for o in outs)


def main(argv: list[str]) -> int:
    url, path, conc = argv[0], argv[1], int(argv[2])
    with open(path, "rb") as f:
        bodies = [line.rstrip(b"\n") for line in f if line.strip()]
    print(json.dumps(asyncio.run(client_process(url, bodies, conc))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
