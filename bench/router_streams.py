"""Many concurrent streams through one router: held with no error, memory bounded.

The tests' fake prefill and decode workers (``pdserve/testing/router_fakes.py``, in a child process,
as in ``bench/router_throughput.py``), the decode one pacing its tokens ``--token-delay``
apart, and ``pdserve router`` in front (decode-direct). ``--streams`` streamed completions
are opened at once and read to their end; meanwhile the router's resident memory (all its
processes) is sampled. Reports errors, how long the streams took against the pacing's own
lower bound, and the router's RSS idle (after a warm-up), at its peak and after the streams
ended: MB, and KB per stream at the peak. The last stdout line is JSON.

    nice python bench/router_streams.py               # 1,000 streams
    python bench/router_streams.py --quick            # the test's run (200 streams)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import aiohttp
from lib import flags
from lib.loopback import secret_env, tiny_model
from router_throughput import ROOT, body, child, load_avg, one, router_flags, wait_ready


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser(__doc__, "200 streams (the test's run)")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--token-delay", type=float, default=0.1, help="the fake decode's pacing, s")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--procs", type=int, default=1, help="router processes (--procs)")
    args = p.parse_args(argv)
    if args.quick:
        args.streams = 200
    return args


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (the router's processes), MB."""
    with open(f"/proc/{pid}/statm") as f:
        own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return own + sum(rss_mb(int(c)) for c in f.read().split())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.testing.loopback import free_port

    model, env = str(tiny_model()), secret_env()
    fakes = [
        sys.executable,
        str(ROOT / "bench" / "router_throughput.py"),
        "--fakes",
        "--token-delay",
        str(args.token_delay),
    ]
    result: dict[str, Any] = {
        "load_avg_1m_before": load_avg(),
        "streams": args.streams,
        "procs": args.procs,
        "token_delay_s": args.token_delay,
        "max_tokens": args.max_tokens,
    }
    with child(fakes, env) as fk:
        assert fk.stdout is not None
        urls = json.loads(await asyncio.to_thread(fk.stdout.readline))
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve", "router", *router_flags(model, urls, port)]
        cmd += ["--disagg-threshold", "100000", "--procs", str(args.procs)]
        cmd += ["--max-queue", str(2 * args.streams)]
        url = f"http://127.0.0.1:{port}"
        with child(cmd, env) as router:
            conn = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(
                connector=conn, timeout=aiohttp.ClientTimeout(total=600)
            ) as http:
                await wait_ready(http, url)
                result.update(await hold(args, http, url, router.pid))
    result["load_avg_1m_after"] = load_avg()
    return result


async def hold(
    args: argparse.Namespace, http: aiohttp.ClientSession, url: str, pid: int
) -> dict[str, Any]:
    rng = random.Random(0)
    hdr = {"content-type": "application/json"}
    one_body = vars(argparse.Namespace(prompt_tokens=args.prompt_tokens, max_tokens=2))
    for _ in range(20):  # warm-up: connections, caches, the first allocations
        await one(
            http,
            url + "/v1/completions",
            json.dumps(body(argparse.Namespace(**one_body), rng, False)).encode(),
            hdr,
        )
    idle = rss_mb(pid)
    ns = argparse.Namespace(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    bodies = [json.dumps(body(ns, rng, False)).encode() for _ in range(args.streams)]
    peak, done = idle, asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.1)

    async def stream(b: bytes) -> bool:
        try:
            await one(http, url + "/v1/completions", b, hdr)
            return True
        except (TimeoutError, aiohttp.ClientError, RuntimeError):
            return False

    sampler = asyncio.create_task(sample())
    t0 = time.perf_counter()
    ok = await asyncio.gather(*(stream(b) for b in bodies))
    wall = time.perf_counter() - t0
    done.set()
    await sampler
    await asyncio.sleep(1.0)
    after = rss_mb(pid)
    return {
        "errors": ok.count(False),
        "wall_s": round(wall, 2),
        "paced_floor_s": round(args.max_tokens * args.token_delay, 2),
        "rss_idle_mb": round(idle, 1),
        "rss_peak_mb": round(peak, 1),
        "rss_after_mb": round(after, 1),
        "kb_per_stream_at_peak": round(1024 * (peak - idle) / args.streams, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
