"""Speculative decoding benchmark: `pdserve up` with speculation off vs n-gram on.

Two services on the same model side by side (the default model of ``pdserve up``,
SmolLM2-135M-Instruct; its default topology, one prefill and one decode worker, so the
decode worker drafts after it receives the KV), one started with ``--speculative
ngram:k=K``. Two workloads named before the run (bench/speculative_workloads.py):
``repetitive`` (edit this code, quote the document) and ``chat`` (open-ended). Each
request is a greedy chat completion of up to ``--max-tokens`` tokens at concurrency
``--concurrency``; a run sends every prompt of a workload once, and output tokens/s is its
completion tokens over its wall time. ``--repeats`` rounds, each running off then on for
each workload (interleaved, so that drifting load from other jobs on the host falls on
both); the speedup is the median over rounds of on / off. Greedy output is the same with
and without speculation: the share of identical completions is reported too.

Last stdout line: JSON with ``spec_speedup_repetitive`` and ``spec_speedup_chat`` (medians),
each round's figures, the acceptance rate and tokens per step from the decode worker's
/metrics, and the load average.

    python bench/speculative.py              # SmolLM2, 3 rounds (minutes)
    python bench/speculative.py --quick      # tiny model, one round, a few tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from lib import flags
from serve import start_ours, stop
from speculative_workloads import WORKLOADS

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny model, one round, few tokens")
    p.add_argument("--model", default="", help="model directory (default: pdserve up's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--speculative", default="ngram:k=4")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=8760, help="router port (off; on: +1000)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--worker-arg", action="append", default=[])
    args = p.parse_args()
    if args.quick:
        args.max_tokens, args.repeats, args.enforce_eager = 24, 1, True
        if not args.model:
            from pdserve.engine.tiny_model import write_tiny_model

            cache = ROOT / ".cache" / "test-models" / "tiny-seed0"
            args.model = str(write_tiny_model(cache, preset="tiny", seed=0))
    return args


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[int, str]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    return int(data["usage"]["completion_tokens"]), data["choices"][0]["message"]["content"]


async def run_workload(
    url: str, prompts: list[str], args: argparse.Namespace
) -> tuple[float, list[str]]:
    """Output tokens/s of one pass over ``prompts`` and the completions, in order."""
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.concurrency)

        async def one(p: str) -> tuple[int, str]:
            async with sem:
                return await _one(client, url, model, p, args.max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    return sum(n for n, _ in results) / wall, [t for _, t in results]


def spec_metrics(url: str) -> dict[str, float]:
    """The decode workers' acceptance rate and tokens per step (their /metrics)."""
    workers = httpx.get(f"{url}/workers", timeout=10).json()
    out: dict[str, float] = {}
    for w in workers.get("workers", workers if isinstance(workers, list) else []):
        if w.get("role") != "decode":
            continue
        text = httpx.get(f"{w['url']}/metrics", timeout=10).text
        for line in text.splitlines():
            for name in ("acceptance_rate", "tokens_per_step"):
                if line.startswith(f"pdserve_spec_decode_{name}{{"):
                    out[name] = round(float(line.rsplit(" ", 1)[1]), 3)
    return out


def start(name: str, model: str, args: argparse.Namespace, port: int, extra: list[str]) -> Any:
    ns = argparse.Namespace(dtype=args.dtype, port=port, worker_arg=args.worker_arg + extra)
    proc, url, _ = start_ours("default", model, ns)  # 1 prefill + 1 decode worker
    return proc, url


def main() -> int:
    args = parse_args()
    load_start = [round(x, 2) for x in os.getloadavg()]
    from pdserve.local.up import ensure_model

    model = ensure_model(args.model, args.dtype)
    extra = ["--enforce-eager"] if args.enforce_eager else []
    off_proc, off_url = start("off", model, args, args.port, extra)
    try:
        on_proc, on_url = start(
            "on", model, args, args.port + 1000, [*extra, f"--speculative={args.speculative}"]
        )
        try:
            result = measure(off_url, on_url, args)
            result["spec_metrics"] = spec_metrics(on_url)
        finally:
            stop(on_proc)
    finally:
        stop(off_proc)
    result.update(
        model=Path(model).name,
        speculative=args.speculative,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        load_avg_start=load_start,
        load_avg_end=[round(x, 2) for x in os.getloadavg()],
        cpus=os.cpu_count(),
    )
    print(json.dumps(result))
    return 0


def measure(off_url: str, on_url: str, args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    same = {w: 0 for w in WORKLOADS}
    for prompts in WORKLOADS.values():  # warm-up: each workload's first prompt (not timed)
        asyncio.run(run_workload(off_url, prompts[:1], args))
        asyncio.run(run_workload(on_url, prompts[:1], args))
    for r in range(args.repeats):
        row: dict[str, Any] = {"load_avg": [round(x, 2) for x in os.getloadavg()]}
        for w, prompts in WORKLOADS.items():
            off, off_text = asyncio.run(run_workload(off_url, prompts, args))
            on, on_text = asyncio.run(run_workload(on_url, prompts, args))
            same[w] += sum(a == b for a, b in zip(off_text, on_text, strict=True))
            row[w] = {
                "off_tok_s": round(off, 1),
                "on_tok_s": round(on, 1),
                "speedup": round(on / off, 3),
            }
            print(f"  round {r + 1} {w}: {row[w]}", file=sys.stderr)
        rounds.append(row)
    out: dict[str, Any] = {}
    for w, prompts in WORKLOADS.items():
        out[f"spec_speedup_{w}"] = round(statistics.median(x[w]["speedup"] for x in rounds), 3)
        out[f"identical_share_{w}"] = round(same[w] / (len(prompts) * args.repeats), 3)
    out["rounds"] = rounds
    return out


if __name__ == "__main__":
    sys.exit(main())
