"""Structured outputs: output tok/s of JSON-schema-constrained vs free requests, same load.

The same requests (random prompts, the same max_tokens, seeded sampling at temperature
1) run through ``LLMEngine`` twice per round, free and constrained by a JSON schema
whose outputs are longer than max_tokens (an open-ended array of short strings), so
both runs produce the same tokens per request in the same batch shapes: the difference
is the grammar's cost (mask fill per row, one batched mask apply, token accept). Rounds
alternate the two so that load from other processes falls on both alike; the best
round of each is reported, by this process's CPU time (one thread: robust to other
load on a shared host; wall-clock figures are printed beside). Grammars are compiled
(and cached) before timing, as the workers do off the engine thread. The last stdout line is JSON:
``{"free_tok_s", "constrained_tok_s", "ratio", ...}``.

    python bench/structured.py            # 64 requests on the small model
    python bench/structured.py --quick    # tiny model, 8 requests (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.tiny_model import write_tiny_model  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402

# At least 64 items: no output completes within max_tokens, so both runs decode the same
# number of tokens in the same batch shapes.
SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 64}},
    "required": ["items"]}  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few requests, seconds")
    p.add_argument("--preset", default="small")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "structured.png"))
    args = p.parse_args()
    if args.quick:
        args.preset, args.requests, args.max_tokens, args.rounds = "tiny", 8, 32, 2
    return args


def run(
    engine: LLMEngine, prompts: list[list[int]], args: Any, constrained: bool
) -> tuple[float, float]:
    """Output tokens per CPU second and per wall second of one pass over the requests."""
    spec = {"type": "json_schema", "schema": SCHEMA, "param": "response_format"}
    for i, prompt in enumerate(prompts):
        extra: dict[str, Any] = {"structured": spec} if constrained else {"ignore_eos": True}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, **extra)
        engine.add_request(f"{'c' if constrained else 'f'}{i}-{time.monotonic()}", prompt, params)
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    assert tokens == len(prompts) * args.max_tokens, "both runs must decode the same tokens"
    return tokens / (time.process_time() - c0), tokens / (time.perf_counter() - t0)


def plot(path: str, result: dict[str, Any]) -> None:
    plt = figures.pyplot()

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(["free", "json_schema"], [result["free_tok_s"], result["constrained_tok_s"]],
           color=["#888", "#2a7"])  # fmt: skip
    ax.set_ylabel("output tokens per CPU second")
    ax.set_title(f"structured outputs: {result['ratio']:.2f}x of free ({result['preset']})")
    figures.save(fig, path, dpi=100)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cache = Path(os.environ.get("PDSERVE_TEST_CACHE", ROOT / ".cache" / "test-models"))
    model = write_tiny_model(cache / f"{args.preset}-seed0", preset=args.preset, seed=0)
    cfg = EngineConfig(model=str(model), dtype="float32", kv_cache_bytes=256 << 20)
    engine = LLMEngine(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, engine.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]  # fmt: skip
    engine.grammars.compile({"type": "json_schema", "schema": SCHEMA})
    free, constrained = [], []
    for _ in range(args.rounds):
        free.append(run(engine, prompts, args, constrained=False))
        constrained.append(run(engine, prompts, args, constrained=True))
    best_free, best_con = max(free), max(constrained)
    result = {
        "free_tok_s": round(best_free[0], 1),
        "constrained_tok_s": round(best_con[0], 1),
        "ratio": round(best_con[0] / best_free[0], 3),
        "free_wall_tok_s": round(best_free[1], 1),
        "constrained_wall_tok_s": round(best_con[1], 1),
        "preset": args.preset,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "quick": args.quick,
    }
    assert engine.kv.all_free, "KV blocks leaked"
    plot(args.plot, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
