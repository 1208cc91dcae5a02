"""Prefix-aware routing vs round-robin, and the router's own overhead, in one run.

Starts 2 prefill + 1 decode real workers (``pdserve.local.processes``) and two
routers in front of them: one ``--picker max-score``, one ``--picker round-robin``.
Workload: G groups x R requests sharing a long system prompt (>= 512 tokens) with
short distinct suffixes, arriving interleaved (each round has every group once,
in a shuffled order); each
router gets its own fresh system prompts. Each prefill worker's KV cache holds
half the groups' prefixes (plus a few blocks for suffixes), so the two caches
together hold the working set once: spreading groups by prefix keeps every group
cached, while round-robin makes every worker cycle through all groups (LRU
thrash). Then the router's overhead: short prompts (local prefill) through the
router vs straight to the decode worker's ``/generate``, and through a bare proxy
(``bench/bare_proxy.py``) as the floor any extra hop costs; each path gets its own
prompts of the same length (a prompt sent twice would hit the prefix cache the second
time and flatter whichever path went second).

Hit ratio = cached prompt tokens / prompt tokens (from each response's usage).
The last stdout line is JSON with ``prefix_hit_ratio``, ``rr_hit_ratio``,
``prefix_ttft_p50_ms``, ``rr_ttft_p50_ms``, ``ttft_p50_speedup``,
``router_overhead_p50_ms``, ``proxy_overhead_p50_ms`` and more.

    python bench/routing.py            # small preset, 8 x 16 requests
    python bench/routing.py --quick    # tiny preset, 4 x 3 requests
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script
import httpx
from lib import flags
from lib.completions import greedy_stream
from lib.stats import percentile

from pdserve.local.processes import ClusterSpec, LocalCluster
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.contract import GenerateRequest, TokenDelta
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.transfer.registry import DEFAULT_TRANSPORT, TRANSPORT_NAMES

ROOT = Path(__file__).resolve().parent.parent

BLOCK = 16


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The shared-prefix workload's and its cluster's flags (also bench/multi_router.py's)."""
    p.add_argument("--quick", action="store_true", help="tiny model, few requests")
    p.add_argument("--model", default="", help="model dir (default: write the preset model)")
    p.add_argument("--preset", default="small", help="tiny-model preset when --model is unset")
    flags.add_ints(p, groups=8, per_group=16, system_tokens=512, max_tokens=4, concurrency=2)
    p.add_argument("--kv-transport", default=DEFAULT_TRANSPORT, choices=TRANSPORT_NAMES)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    p.add_argument(
        "--worker-port-base",
        type=int,
        default=8100,
        help="the workers' ports: prefill from here, decode from +100",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(p)
    p.add_argument(
        "--cache-groups",
        type=float,
        default=0.0,
        help="prefill KV cache size in groups' prefixes (default groups/2)",
    )
    p.add_argument("--overhead-requests", type=int, default=60)
    args = p.parse_args(argv)
    if args.quick:
        # the suite's run (issue 45): every phase, fewest requests; the figures are the full run's
        args.preset, args.groups, args.per_group, args.overhead_requests = "tiny", 4, 3, 8
    return args


def ensure_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from pdserve.engine.tiny_model import write_tiny_model

    return str(write_tiny_model(ROOT / ".cache" / "models" / f"{args.preset}-seed0", args.preset))


def kv_block_bytes(model_dir: str, dtype: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    # MLA (DeepSeek): the pool's head size is K's, nope + rope (engine/model_support.py).
    mla = cfg.get("qk_nope_head_dim", 0) + cfg.get("qk_rope_head_dim", 0)
    head_dim = mla or cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    elem = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    return int(cfg["num_hidden_layers"] * 2 * BLOCK * kv_heads * head_dim * elem)


def prefill_cache_bytes(args: argparse.Namespace, model_dir: str, cache_groups: float) -> int:
    """A KV cache for ``cache_groups`` groups' prefixes, plus a few blocks for suffixes."""
    per_prefix = -(-(args.system_tokens + 16) // BLOCK)
    return int(per_prefix * cache_groups + 8) * kv_block_bytes(model_dir, args.dtype)


def cluster_spec(
    args: argparse.Namespace, model_dir: str, cache_bytes: int, logs: str
) -> ClusterSpec:
    """2 prefill workers with ``cache_bytes`` of KV cache each and 1 decode worker; their
    logs in ``--out``/``logs``."""
    return ClusterSpec(
        model_dir=model_dir,
        num_prefill=2,
        num_decode=1,
        dtype=args.dtype,
        kv_transport=args.kv_transport,
        served_model_name="bench",
        worker_port_base=args.worker_port_base,
        prefill_args=("--kv-cache-bytes", str(cache_bytes)),
        log_dir=str(Path(args.out) / logs),
    )


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[tuple[int, list[int]]]:
    """(group, token ids) in arrival order: interleaved groups, distinct short suffixes."""
    rng = random.Random(seed)
    low = 16  # keep clear of the special tokens at the start of the vocabulary
    systems = [
        [rng.randrange(low, vocab) for _ in range(args.system_tokens)] for _ in range(args.groups)
    ]
    out = []
    for r in range(args.per_group):
        # Every round has each group once, in a fresh order: interleaved, and without the
        # fixed period that would let round-robin land each group on the same worker.
        for g in rng.sample(range(args.groups), args.groups):
            suffix = [rng.randrange(low, vocab) for _ in range(8 + r % 8)]
            out.append((g, systems[g] + suffix))
    return out


def sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def via_router(
    h: httpx.AsyncClient, url: str, model: str, ids: list[int], max_tokens: int
) -> dict[str, Any]:
    body = greedy_stream(model, ids, max_tokens)
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with h.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"router answered {resp.status_code}: {(await resp.aread())[:300]!r}"
            )
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(f"stream error: {msg['error']}")
            if msg.get("choices") and ttft is None:
                ttft = time.perf_counter() - t0
            usage = msg.get("usage") or usage
    assert ttft is not None and usage is not None
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "ttft": ttft,
        "e2e": time.perf_counter() - t0,
        "prompt": usage["prompt_tokens"],
        "cached": cached,
        "tokens": usage["completion_tokens"],
    }


async def direct_decode(h: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int) -> dict:
    req = GenerateRequest(f"bench-{uuid.uuid4().hex}", ids, SamplingParams(**sampling(max_tokens)))
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with h.stream("POST", url + "/generate", content=encode(req)) as resp:
        assert resp.status_code == 200, resp.status_code
        async for line in resp.aiter_lines():
            if not line.strip():
                continue
            msg = decode(line, TokenDelta)
            assert msg.error is None, msg
            if msg.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += len(msg.token_ids)
    assert ttft is not None
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": tokens}


async def run_phase(h, url, model, prompts, args) -> list[dict[str, Any]]:
    """Send prompts in arrival order with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(args.concurrency)

    async def one(g: int, ids: list[int]) -> dict[str, Any]:
        async with sem:
            return {"group": g, **await via_router(h, url, model, ids, args.max_tokens)}

    tasks = []
    for g, ids in prompts:
        tasks.append(asyncio.create_task(one(g, ids)))
        await asyncio.sleep(0)  # keep arrival order
    return list(await asyncio.gather(*tasks))


@contextlib.contextmanager
def bare_proxy(worker_url: str) -> Iterator[str]:
    """bench/bare_proxy.py in front of ``worker_url``, for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [sys.executable, str(ROOT / "bench" / "bare_proxy.py"), worker_url, str(port)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "bare proxy did not start"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of latencies in seconds, in milliseconds."""
    return percentile(xs, q) * 1000.0


async def overhead(h, router_url, decode_url, proxy_url, model, vocab, args) -> dict[str, float]:
    """Same short prompts (local prefill) through the router, straight to the decode worker
    and through a bare proxy (bench/bare_proxy.py: the cost of the extra hop alone), in
    turn so all three see the same load; then throughput at concurrency 8."""
    rng = random.Random(99)

    def fresh() -> list[list[int]]:  # every path its own prompts: none hits another's cache
        return [
            [rng.randrange(16, vocab) for _ in range(24)] for _ in range(args.overhead_requests)
        ]

    via, direct, proxied = [], [], []
    for a, b, c in zip(fresh(), fresh(), fresh(), strict=True):
        via.append((await via_router(h, router_url, model, a, args.max_tokens))["ttft"])
        direct.append((await direct_decode(h, decode_url, b, args.max_tokens))["ttft"])
        proxied.append((await direct_decode(h, proxy_url, c, args.max_tokens))["ttft"])

    async def throughput(fn) -> float:
        sem = asyncio.Semaphore(8)

        async def one(ids):
            async with sem:
                return (await fn(ids))["tokens"]

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(ids) for ids in fresh())))
        return tokens / (time.perf_counter() - t0)

    n = 16
    tput_router = await throughput(lambda ids: via_router(h, router_url, model, ids, n))
    tput_direct = await throughput(lambda ids: direct_decode(h, decode_url, ids, n))
    return {
        "router_ttft_p50_ms": pct(via, 0.5),
        "direct_ttft_p50_ms": pct(direct, 0.5),
        "router_overhead_p50_ms": pct(via, 0.5) - pct(direct, 0.5),
        "proxy_ttft_p50_ms": pct(proxied, 0.5),
        "proxy_overhead_p50_ms": pct(proxied, 0.5) - pct(direct, 0.5),
        "router_tokens_per_s": tput_router,
        "direct_tokens_per_s": tput_direct,
    }


def summarize(name: str, results: list[dict[str, Any]]) -> dict[str, float]:
    ttft = [r["ttft"] for r in results]
    return {
        f"{name}_hit_ratio": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        f"{name}_ttft_p50_ms": pct(ttft, 0.5),
        f"{name}_ttft_p99_ms": pct(ttft, 0.99),
        f"{name}_requests": float(len(results)),
    }


def plot(prefix: list[dict], rr: list[dict], summary: dict[str, float], path: Path) -> None:
    plt = figures.pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in (("prefix-aware", prefix), ("round-robin", rr)):
        xs = sorted(r["ttft"] * 1000 for r in res)
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    a.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT through the router")
    a.legend()
    names = ["prefix hit", "rr hit"]
    b.bar(names, [summary["prefix_hit_ratio"], summary["rr_hit_ratio"]], color=["C0", "C1"])
    b.set(ylim=(0, 1), title="prefix-cache hit ratio (tokens)")
    fig.suptitle(
        f"TTFT p50 speedup {summary['ttft_p50_speedup']:.2f}x, router overhead p50 "
        f"{summary['router_overhead_p50_ms']:.2f} ms (bare proxy "
        f"{summary['proxy_overhead_p50_ms']:.2f} ms)"
    )
    figures.save(fig, path, dpi=100)


async def measure(
    cluster: LocalCluster,
    routers: dict[str, str],
    proxy_url: str,
    model: str,
    vocab: int,
    args: argparse.Namespace,
) -> tuple[dict, list, list]:
    limits = httpx.Limits(max_connections=64)
    # Signed calls go to the router too (it ignores the signature): one client for all paths.
    async with httpx.AsyncClient(timeout=600, limits=limits, auth=cluster.auth) as h:
        for url in routers.values():  # warm up every worker's code paths (not measured)
            for _, ids in workload(args, vocab, seed=1)[:4]:
                await via_router(h, url, model, ids[:200], args.max_tokens)
        prefix = await run_phase(h, routers["prefix"], model, workload(args, vocab, 2), args)
        rr = await run_phase(h, routers["rr"], model, workload(args, vocab, 3), args)
        over = await overhead(
            h, routers["prefix"], cluster.urls("decode")[0], proxy_url, model, vocab, args
        )
    summary = {**summarize("prefix", prefix), **summarize("rr", rr), **over}
    summary["ttft_p50_speedup"] = summary["rr_ttft_p50_ms"] / summary["prefix_ttft_p50_ms"]
    return summary, prefix, rr


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = ensure_model(args)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    cache_bytes = prefill_cache_bytes(args, model_dir, args.cache_groups or args.groups / 2)
    spec = cluster_spec(args, model_dir, cache_bytes, "routing-logs")
    common = ["--disagg-threshold", "64", "--max-queue", "1024"]
    with LocalCluster(spec) as cluster:
        cluster.start_workers()
        routers = {
            "prefix": cluster.start_router(
                0, "router-prefix", ["--picker", "max-score", *common]
            ).url,
            "rr": cluster.start_router(0, "router-rr", ["--picker", "round-robin", *common]).url,
        }
        cluster.wait_healthy(600, on_ready=lambda p, s: print(f"{p.name} ready ({s:.1f}s)"))
        for proc in cluster.procs:
            if proc.role == "router":
                cluster.wait_routed(proc)
        with bare_proxy(cluster.urls("decode")[0]) as proxy_url:
            summary, prefix, rr = asyncio.run(
                measure(cluster, routers, proxy_url, "bench", vocab, args)
            )
    summary.update(
        groups=args.groups,
        per_group=args.per_group,
        system_tokens=args.system_tokens,
        prefill_cache_bytes=cache_bytes,
        quick=args.quick,
    )
    plot(
        prefix, rr, summary, Path(args.out) / ("routing-quick.png" if args.quick else "routing.png")
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
