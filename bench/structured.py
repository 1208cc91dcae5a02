"""Structured outputs: output tok/s of JSON-schema-constrained vs free requests, same load.

The same requests (random prompts, the same max_tokens, seeded sampling at temperature
1) run through ``LLMEngine`` twice per round, free and constrained by a JSON schema
whose outputs are longer than max_tokens (an open-ended array of short strings), so
both runs produce the same tokens per request in the same batch shapes: the difference
is the grammar's cost (the masks filled, applied, each token accepted). Rounds
alternate the order (free first, then constrained first, ...) so that drifting load
from other processes falls on both alike; their number is even, because on a busy host
the second pass of a round ran slower whichever it was (wall 0.70 and 0.65 with the
constrained pass second, 1.17 with it first, CPU time 0.95-0.99 in all three: 2026-12-03,
load average 20-26). The headline is wall clock: ``ratio`` is the
median over rounds of constrained / free wall-clock tok/s, ``ratio_range`` its min and
max; ``ratio_cpu`` (this process's CPU time) is the second row; ``ratio_unqueued``
divides wall time less the engine thread's waits in the run queue (Linux schedstat:
runnable but another process on the CPU), which shows where the wall time went. Grammars
are compiled (and cached) before timing, as the workers do off the engine thread; the first, cold
compile is timed apart (``compile_s``). Each JSON line records ``os.getloadavg()`` and
the thread settings. The last stdout line is JSON:
``{"free_wall_tok_s", "constrained_wall_tok_s", "ratio", "ratio_range", "ratio_cpu", ...}``.

    python bench/structured.py            # 64 requests on the small model, 6 rounds
    python bench/structured.py --quick    # tiny model, 8 requests (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script
from lib import flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

# At least 64 items: no output completes within max_tokens, so both runs decode the same
# number of tokens in the same batch shapes.
SCHEMA = {
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 64}
    },
    "required": ["items"],
}


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny model, few requests, seconds")
    p.add_argument("--preset", default="small")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6, help="even: each order equally often")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "structured.png"))
    args = p.parse_args()
    if args.quick:
        args.preset, args.requests, args.max_tokens, args.rounds = "tiny", 8, 32, 2
    if args.rounds < 2 or args.rounds % 2:
        p.error("--rounds must be even and at least 2: free first and constrained first alike")
    return args


def _schedstat() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one): Linux's
    /proc/thread-self/schedstat; (0, 0) where it is missing."""
    try:
        on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def run(
    engine: LLMEngine, prompts: list[list[int]], args: Any, constrained: bool
) -> tuple[float, float, float]:
    """Output tokens per CPU second, per wall second, and per wall second less the time
    the engine thread waited for a CPU (runnable, not running: other load) in one pass."""
    spec = {"type": "json_schema", "schema": SCHEMA, "param": "response_format"}
    for i, prompt in enumerate(prompts):
        extra: dict[str, Any] = {"structured": spec} if constrained else {"ignore_eos": True}
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, **extra)
        engine.add_request(f"{'c' if constrained else 'f'}{i}-{time.monotonic()}", prompt, params)
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    _, w0 = _schedstat()
    while engine.has_work:
        tokens += sum(len(o.token_ids) for o in engine.step())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    queued = _schedstat()[1] - w0
    assert tokens == len(prompts) * args.max_tokens, "both runs must decode the same tokens"
    return tokens / cpu, tokens / wall, tokens / max(wall - queued, 1e-9)


def plot(path: str, result: dict[str, Any]) -> None:
    plt = figures.pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = ["free", "json_schema"]
    wall = [result["free_wall_tok_s"], result["constrained_wall_tok_s"]]
    cpu = [result["free_tok_s"], result["constrained_tok_s"]]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], wall, width=0.4, label="wall clock (median)", color="#2a7")
    ax.bar([x + 0.2 for x in xs], cpu, width=0.4, label="CPU time (median)", color="#888")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("output tokens / s")
    ax.legend()
    ax.set_title(
        f"structured outputs: {result['ratio']:.2f}x wall ({result['ratio_range'][0]:.2f}"
        f"-{result['ratio_range'][1]:.2f}), {result['ratio_cpu']:.2f}x CPU "
        f"({result['preset']})",
        fontsize=9,
    )
    figures.save(fig, path, dpi=100)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_start = [round(x, 2) for x in os.getloadavg()]
    cache = Path(os.environ.get("PDSERVE_TEST_CACHE", ROOT / ".cache" / "test-models"))
    model = write_tiny_model(cache / f"{args.preset}-seed0", preset=args.preset, seed=0)
    cfg = EngineConfig(model=str(model), dtype="float32", kv_cache_bytes=256 << 20)
    engine = LLMEngine(cfg)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, engine.vocab_size) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    t0 = time.perf_counter()
    engine.grammars.compile({"type": "json_schema", "schema": SCHEMA})
    compile_s = time.perf_counter() - t0
    run(engine, prompts[:2], args, constrained=False)  # warm: first-call costs out of round 0
    run(engine, prompts[:2], args, constrained=True)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        before = [round(x, 2) for x in os.getloadavg()]
        order = [False, True] if i % 2 == 0 else [True, False]
        got = {c: run(engine, prompts, args, constrained=c) for c in order}
        (free_cpu, free_wall, free_own), (con_cpu, con_wall, con_own) = got[False], got[True]
        rounds.append(
            {
                "free_tok_s": round(free_cpu, 1),
                "constrained_tok_s": round(con_cpu, 1),
                "free_wall_tok_s": round(free_wall, 1),
                "constrained_wall_tok_s": round(con_wall, 1),
                "ratio": round(con_wall / free_wall, 3),
                "ratio_cpu": round(con_cpu / free_cpu, 3),
                "ratio_unqueued": round(con_own / free_own, 3),
                "free_unqueued_tok_s": round(free_own, 1),
                "constrained_unqueued_tok_s": round(con_own, 1),
                "load_avg": before,
            }
        )
        print(json.dumps(rounds[-1]), file=sys.stderr)

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 3)

    result = {
        "ratio": med("ratio"),  # the headline: wall clock
        "ratio_range": [min(r["ratio"] for r in rounds), max(r["ratio"] for r in rounds)],
        "ratio_cpu": med("ratio_cpu"),
        "ratio_cpu_range": [
            min(r["ratio_cpu"] for r in rounds),
            max(r["ratio_cpu"] for r in rounds),
        ],
        # Wall clock less the engine thread's waits for a CPU (other processes' load):
        # what is left is the path's own time, the CPU's and any sleeps.
        "ratio_unqueued": med("ratio_unqueued"),
        "ratio_unqueued_range": [
            min(r["ratio_unqueued"] for r in rounds),
            max(r["ratio_unqueued"] for r in rounds),
        ],
        "free_wall_tok_s": med("free_wall_tok_s"),
        "constrained_wall_tok_s": med("constrained_wall_tok_s"),
        "free_tok_s": med("free_tok_s"),
        "constrained_tok_s": med("constrained_tok_s"),
        "compile_s": round(compile_s, 3),
        "grammars_compiled": engine.grammars.num_compiled,  # one schema: once, not per request
        "rounds": rounds,
        "preset": args.preset,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": load_start,
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        "quick": args.quick,
    }
    assert engine.kv.all_free, "KV blocks leaked"
    plot(args.plot, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
