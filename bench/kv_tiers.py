"""KV tiers: a shared-document workload whose working set is >= 10x the pool, served by one
engine with tiers off, host, disk and shared (a real redis-server on loopback), side by side.

Workload (named before the run): ``--docs`` documents of ``--doc-tokens`` random tokens,
each asked ``--rounds`` questions (a short suffix) in turn: round r asks every document's
question r, documents in a fixed order, one request at a time. The pool holds
``--pool-blocks`` blocks; the documents together are ``working_set_x`` times that (>= 10),
so with LRU eviction every document has left the pool before it is asked again: without
tiers each question is a whole prefill, with a tier its document comes back from below.
Round 0 fills the tiers (cold for every setting) and is not measured.

Measured per setting, over rounds 1..: TTFT p50/p90 (engine side: from ``add_request`` to
the request's first token, the engine stepping as its core loop does), the hit ratio
(prompt tokens served from the pool or a tier / prompt tokens), tier hits. Then the
recompute fallback: the shared setting again, with the redis-server killed after round
0 (every load fails): every request must still finish, at about the TTFT of tiers off.

The last stdout line is JSON: ``tiers_ttft_p50_ratio`` (the best tier setting, named
before the run by ``--best``, default host: its TTFT p50 / tiers off), ``tiers_hit_ratio``
(that setting's), and per setting ``{ttft_p50_ms, ttft_p90_ms, hit_ratio, tier_hits}``.

    python bench/kv_tiers.py           # small preset, 14 documents of 960 tokens (minutes)
    python bench/kv_tiers.py --quick   # tiny model, short documents (seconds; shape only)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_pool import KVShape
from pdserve.engine.kv_tiers.attach import attach, detach
from pdserve.engine.kv_tiers.config import TierConfig
from pdserve.engine.kv_tiers.redis_server import LocalRedis, start_redis
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = ("off", "host", "disk", "shared")
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: a tiny preset)")
    p.add_argument("--preset", default="small", choices=["tiny", "small"])
    p.add_argument("--docs", type=int, default=14)
    p.add_argument("--doc-tokens", type=int, default=960)
    p.add_argument("--rounds", type=int, default=3, help="questions per document (1 cold)")
    p.add_argument("--pool-blocks", type=int, default=72)
    p.add_argument(
        "--best",
        default="host",
        choices=SETTINGS[1:],
        help="the tier setting whose ratio is the headline (named before the run)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:  # shape only: 14 documents of 3 blocks over a pool of 4 (10.5x)
        args.preset, args.docs, args.doc_tokens, args.rounds = "tiny", 14, 48, 2
        args.pool_blocks = 4
    return args


def workload(args: argparse.Namespace, vocab: int) -> list[list[list[int]]]:
    """rounds x docs prompts: document tokens + a 5-token question of that round."""
    rng = random.Random(0)
    docs = [[rng.randrange(50, vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    return [
        [d + [rng.randrange(50, vocab) for _ in range(5)] for d in docs] for _ in range(args.rounds)
    ]


def run_one(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
    """TTFT (s) and cached prompt tokens of one request run alone."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, PARAMS)
    ttft, cached = 0.0, 0
    while engine.has_work:
        s = engine.scheduler
        if s.num_loading and not s.running and not s.waiting:
            time.sleep(0.0005)  # as the core loop: only loads in flight, poll without spinning
        for out in engine.step():
            if out.token_ids and not ttft:
                ttft = time.perf_counter() - start
            if out.finished:
                cached = out.num_cached_tokens
    return ttft, cached


def kv_shape(model: str) -> KVShape:
    """The model's KV block (float32), read from its config: the pool is sized in blocks."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model, local_files_only=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return KVShape(c.num_hidden_layers, kv_heads, head_dim, 16, torch.float32)


def tier_config(setting: str, work_bytes: int, tmp: Path, redis: LocalRedis | None) -> Any:
    room = 2 * work_bytes
    if setting == "host":
        return TierConfig(host_bytes=room)
    if setting == "disk":
        return TierConfig(disk_path=str(tmp / "disk"), disk_bytes=room)
    if setting == "shared":
        assert redis is not None
        return TierConfig(shared_url=redis.url, load_timeout_s=2.0)
    return None


def serve(
    engine: LLMEngine,
    setting: str,
    tiers: TierConfig | None,
    prompts: list[list[list[int]]],
    kill: LocalRedis | None = None,
) -> dict[str, Any]:
    """One setting on the one engine: its tiers attached for the run, detached after."""
    if tiers is not None:
        engine.tier_store = attach(engine, tiers)
    for i, prompt in enumerate(prompts[0]):  # round 0: cold everywhere, fills the tiers
        run_one(engine, f"{setting}-0-{i}", prompt)
    if engine.tier_store is not None:
        engine.tier_store.flush(60)
    if kill is not None:
        kill.stop()  # the injected failure: the shared store is gone
    ttfts, cached, total = [], 0, 0
    for r, round_prompts in enumerate(prompts[1:], 1):
        for i, prompt in enumerate(round_prompts):
            t, c = run_one(engine, f"{setting}-{r}-{i}", prompt)
            ttfts.append(t)
            cached += c
            total += len(prompt)
    assert engine.kv.all_free and not engine.requests, "KV blocks leaked"
    store = engine.tier_store
    out = {
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 2),
        "ttft_p90_ms": round(statistics.quantiles(ttfts, n=10)[-1] * 1000, 2),
        "hit_ratio": round(cached / total, 3),
        "requests": len(ttfts),
        "tier_hits": sum(store.stats.hits.values()) if store else 0,
        "tier_errors": sum(store.stats.errors.values()) if store else 0,
    }
    detach(engine)  # closes the store; the next setting starts with a cold pool
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = [round(x, 2) for x in os.getloadavg()]
    model = args.model or str(
        write_tiny_model(ROOT / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    )
    shape = kv_shape(model)
    budget = args.pool_blocks * shape.bytes_per_block
    engine = LLMEngine(
        EngineConfig(model=model, dtype="float32", device="cpu", kv_cache_bytes=budget)
    )
    assert engine.kv.num_blocks == args.pool_blocks and engine.kv.pool.shape == shape
    vocab = engine.vocab_size
    prompts = workload(args, vocab)
    work_blocks = args.docs * (args.doc_tokens // 16)
    work_bytes = work_blocks * (shape.bytes_per_block + 128)
    result: dict[str, Any] = {
        "model": Path(model).name,
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "pool_blocks": args.pool_blocks,
        "working_set_x": round(work_blocks / args.pool_blocks, 1),
        "block_bytes": shape.bytes_per_block,
        "best": args.best,
        "threads": args.threads,
        "load_avg_start": load_start,
    }
    maxmemory = f"{(work_bytes * 2 >> 20) + 16}mb"
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tiers-") as tmp:
        redis = start_redis(maxmemory=maxmemory)
        try:
            for setting in SETTINGS:
                cfg = tier_config(setting, work_bytes, Path(tmp), redis)
                result[setting] = serve(engine, setting, cfg, prompts)
                print(setting, json.dumps(result[setting]), file=sys.stderr, flush=True)
        finally:
            redis.stop()
        doomed = start_redis(maxmemory=maxmemory)
        cfg = tier_config("shared", work_bytes, Path(tmp), doomed)
        result["shared_failed"] = serve(engine, "failed", cfg, prompts, kill=doomed)
    off, best = result["off"], result[args.best]
    result["tiers_ttft_p50_ratio"] = round(best["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
    result["tiers_hit_ratio"] = best["hit_ratio"]
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
