"""CPU per streamed token outside the engine: the router and the decode worker's HTTP path.

Starts two real ``pdserve up --prefill 0 --enforce-eager`` clusters on the tiny model
(loopback): one running a baseline tree (``--baseline``: a checkout directory or a git
ref, default ``main``), one running this checkout. Then, in alternating rounds, runs
``--requests`` streamed completions at ``--concurrency`` against each (greedy,
``ignore_eos``, ``--max-tokens`` each) and reads the CPU time (utime + stime from
/proc) of the router process, of the decode worker process, and of the worker's engine
thread before and after each round. Reported per 1000 streamed tokens: router, worker,
worker minus its engine thread (the HTTP loop and everything else), and their sum, the
"stream path". The streams' texts of both trees are compared (same prompts, greedy).

Run it under ``nice`` (the machine is shared); the last stdout line is JSON.

    nice -n 10 python bench/stream_overhead.py                  # 16 x 64 tokens, 4 rounds
    nice -n 10 python bench/stream_overhead.py --baseline /work/main
    python bench/stream_overhead.py --quick                     # the test's run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import figures  # bench/figures.py, beside this script
from lib import flags
from lib.completions import greedy_stream
from lib.procfs import cpu_seconds, tree_cpu_seconds
from stream_procs import Up, code_tree, pdserve_up

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("router", "worker", "worker_http", "engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = flags.parser(__doc__, "2 rounds of 16 x 16 tokens: the path, not a ratio")
    p.add_argument("--baseline", default="main", help="checkout directory or git ref")
    p.add_argument("--model", default="", help="model dir (default: write the tiny model)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="streams per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4, help="rounds per tree, alternating")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = p.parse_args(argv)
    if args.quick:
        # the suite's run checks the path, not the ratio (issue 45): both rounds' orders,
        # 512 tokens a tree. The stream path's CPU is read in 10 ms ticks (stat(5)), so a
        # ratio wants >= 4,096 tokens a tree (1,024 gave 5.8x on a loaded run): the full run
        args.requests, args.max_tokens, args.rounds = 16, 16, 2
    return args


def ensure_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from pdserve.engine.tiny_model import write_tiny_model

    return str(write_tiny_model(ROOT / ".cache" / "models" / "tiny-seed0", "tiny"))


def prompts(args: argparse.Namespace, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(16, 500) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]


async def one_stream(
    http: aiohttp.ClientSession, url: str, model: str, ids: list[int], max_tokens: int
) -> tuple[str, int]:
    """(the streamed text, completion tokens from the usage chunk) of one completion."""
    body = greedy_stream(model, ids, max_tokens)
    parts, tokens, done, buf = [], 0, False, b""
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for data in resp.content.iter_any():
            *events, buf = (buf + data).split(b"\n\n")
            for event in events:
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    done = True
                    continue
                msg = json.loads(payload)
                if "error" in msg:
                    raise RuntimeError(f"{url}: stream error {msg['error']}")
                parts += [c["text"] for c in msg["choices"]]
                tokens = (msg.get("usage") or {}).get("completion_tokens", tokens)
    if not done or tokens != max_tokens:
        raise RuntimeError(f"{url}: stream ended early ({tokens} tokens, [DONE] {done})")
    return "".join(parts), tokens


async def load(up: Up, args: argparse.Namespace, ids: list[list[int]]) -> tuple[list[str], int]:
    sem = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def go(p: list[int]) -> tuple[str, int]:
            async with sem:
                return await one_stream(http, up.url, up.model, p, args.max_tokens)

        got = await asyncio.gather(*(go(p) for p in ids))
    return [text for text, _ in got], sum(n for _, n in got)


def snapshot(up: Up) -> dict[str, float]:
    worker = tree_cpu_seconds(up.worker_pid)  # the HTTP process and its engine core
    engine = cpu_seconds(*up.engine) if up.engine else 0.0
    return {
        "router": cpu_seconds(up.router_pid),
        "worker": worker,
        "worker_http": worker - engine,
        "engine": engine,
    }


def measure_round(up: Up, args: argparse.Namespace, seed: int, acc: dict[str, Any]) -> list[str]:
    ids = prompts(args, seed)
    before, t0 = snapshot(up), time.perf_counter()
    texts, tokens = asyncio.run(load(up, args, ids))
    wall, after = time.perf_counter() - t0, snapshot(up)
    for part in PARTS:
        acc[part] = acc.get(part, 0.0) + after[part] - before[part]
    acc["tokens"] = acc.get("tokens", 0) + tokens
    acc["wall_s"] = acc.get("wall_s", 0.0) + wall
    return texts


def per_1k(acc: dict[str, Any]) -> dict[str, float]:
    k = acc["tokens"] / 1000
    out = {f"{part}_cpu_s_per_1k": acc[part] / k for part in PARTS}
    out["stream_path_cpu_s_per_1k"] = (acc["router"] + acc["worker_http"]) / k
    out["tok_per_s"] = acc["tokens"] / acc["wall_s"]
    return out


def run(args: argparse.Namespace, model: str, work: Path) -> dict[str, Any]:
    base_tree, base_commit = code_tree(ROOT, args.baseline, work / "trees")
    ours_tree, ours_commit = code_tree(ROOT, str(ROOT), work / "trees")
    acc: dict[str, dict[str, Any]] = {"baseline": {}, "ours": {}}
    same = True
    with pdserve_up({"baseline": base_tree, "ours": ours_tree}, model, work) as (base, ours):
        if base.engine is None or ours.engine is None:
            print("warning: engine thread not found; worker_http includes it", flush=True)
        for up in (base, ours):  # warm-up, not counted
            asyncio.run(load(up, args, prompts(args, 999)[: args.concurrency]))
        for r in range(args.rounds):
            order = (base, ours) if r % 2 == 0 else (ours, base)
            texts = {up.label: measure_round(up, args, r, acc[up.label]) for up in order}
            same = same and texts["baseline"] == texts["ours"]
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    return {
        "baseline": per_1k(acc["baseline"]),
        "ours": per_1k(acc["ours"]),
        "baseline_commit": base_commit,
        "ours_commit": ours_commit,
        "tokens_per_tree": acc["ours"]["tokens"],
        "outputs_identical": same,
    }


def report(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    b, o = res["baseline"], res["ours"]
    print(
        f"\nCPU seconds per 1000 streamed tokens ({args.concurrency} concurrent streams of "
        f"{args.max_tokens} tokens; {res['tokens_per_tree']} tokens per tree)"
    )
    print(
        f"{'':26}{'baseline ' + res['baseline_commit']:>22}{'ours ' + res['ours_commit']:>22}"
        f"{'ours/baseline':>15}"
    )
    ratios = {}
    for key in [*(f"{p}_cpu_s_per_1k" for p in PARTS), "stream_path_cpu_s_per_1k", "tok_per_s"]:
        ratios[key] = o[key] / b[key] if b[key] else float("nan")
        print(f"{key:26}{b[key]:22.3f}{o[key]:22.3f}{ratios[key]:15.2f}")
    print(f"streamed texts identical: {res['outputs_identical']}")
    out = {
        "baseline_commit": res["baseline_commit"],
        "ours_commit": res["ours_commit"],
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "tokens_per_tree": res["tokens_per_tree"],
        "outputs_identical": res["outputs_identical"],
    }
    out.update({f"baseline_{k}": round(v, 4) for k, v in b.items()})
    out.update({f"ours_{k}": round(v, 4) for k, v in o.items()})
    out.update({f"ratio_{k}": round(v, 3) for k, v in ratios.items()})
    return out


def plot(res: dict[str, Any], args: argparse.Namespace) -> Path:
    plt = figures.pyplot()
    keys = ["router", "worker_http", "stream_path"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(keys))
    for i, tree in enumerate(("baseline", "ours")):
        vals = [res[f"{tree}_{k}_cpu_s_per_1k"] for k in keys]
        ax.bar([x + 0.38 * i for x in xs], vals, 0.38, label=f"{tree} {res[tree + '_commit']}")
    ax.set_xticks([x + 0.19 for x in xs], ["router", "decode worker\n(minus engine)", "sum"])
    ax.set_ylabel("CPU s / 1000 streamed tokens")
    ax.set_title(f"{args.concurrency} streams x {args.max_tokens} tokens, tiny model")
    ax.legend()
    path = Path(args.out) / ("stream_overhead-quick.png" if args.quick else "stream_overhead.png")
    figures.save(fig, path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ensure_model(args)
    with tempfile.TemporaryDirectory(prefix="stream-overhead-") as work:
        res = report(run(args, model, Path(work)), args)
    print(f"plot: {plot(res, args)}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
