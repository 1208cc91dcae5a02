"""Multi-LoRA: a batch mixing 8 adapters vs the base model alone, adapter load time, and
routing with adapter affinity on vs off (issue 27).

* throughput: the same requests (random prompts, ignore_eos, greedy) through ``LLMEngine``
  on the ``small`` preset model, all added at once: once on an engine without adapters
  (the base alone), once on an engine with 8 resident adapters (``--max-loras 8``), request
  ``i`` under adapter ``i % 8``: every step mixes all 8. Both eager (a worker with adapters
  runs the eager forward, docs/lora.md), float32, one thread; the arms alternate for
  ``--rounds`` rounds and each keeps its best round (the host is shared). Output tokens/s;
  ``ratio`` = mixed / base (goal >= 0.7), ``ratio_cpu`` the same over this process's CPU
  time (robust to other load).
* load time: ``LoraRegistry.load`` of each adapter (read, checked, copied to host tensors:
  what ``/v1/load_lora_adapter`` and a cache miss cost before the first step).
* routing: bench/lora_routing.py, the router's ``plan_route`` over a simulated pool.

Adapters: PEFT's own (pdserve/testing/lora_adapters.py), ranks 8 and 16, attention-only and
attention + MLP alternately. The last stdout line is JSON; ``load_avg_*`` is
``os.getloadavg()`` before and after.

    python bench/lora.py            # small model, 64 requests (minutes)
    python bench/lora.py --quick    # tiny model, 16 requests (seconds)
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
from lib import flags
from lora_routing import compare

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_files import LoraConfig
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.contract import LoraRef
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.lora_adapters import ATTENTION, MLP, AdapterSpec, write_adapter

ROOT = Path(__file__).resolve().parent.parent

NUM_ADAPTERS = 8
GOAL = 0.7


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny model, few requests, seconds")
    p.add_argument("--preset", default="small")
    flags.add_ints(p, requests=64, prompt_len=(32, 128), output_len=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per arm")
    flags.add_ints(p, threads=1, routing_requests=4000, seed=0)
    args = p.parse_args()
    if args.quick:
        args.preset, args.requests, args.output_len = "tiny", 16, 8
        args.prompt_len, args.rounds, args.routing_requests = [8, 32], 1, 400
    return args


def adapter_specs() -> list[AdapterSpec]:
    return [
        AdapterSpec(
            f"lora{i}", ATTENTION + MLP if i % 2 else ATTENTION, 16 if i % 2 else 8, 16, 100 + i
        )
        for i in range(NUM_ADAPTERS)
    ]


def make_engine(model_dir: Path, args: argparse.Namespace, loras: list[tuple[str, str]]) -> Any:
    lora = (
        LoraConfig(max_loras=NUM_ADAPTERS, max_cpu_loras=2 * NUM_ADAPTERS, loras=tuple(loras))
        if loras
        else None
    )
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            kv_cache_bytes=512 << 20,
            max_num_seqs=args.requests,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
            compile=False,
            lora=lora,
        )
    )


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
        for _ in range(args.requests)
    ]


def run(
    engine: Any, prompts: list[list[int]], out_len: int, names: list[str] | None, tag: str
) -> tuple[float, float]:
    """(output tokens/s wall, output tokens/s of this process's CPU time)."""
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        lora = LoraRef(names[i % len(names)]) if names else None
        engine.add_request(f"{tag}-{i}", prompt, params, lora=lora)
    done = 0
    while engine.has_work:
        done += sum(len(o.token_ids) for o in engine.step())
    assert done == out_len * len(prompts), (done, out_len * len(prompts))
    assert engine.kv.all_free, "KV blocks left allocated"
    return done / (time.perf_counter() - start), done / (time.process_time() - cpu)


def load_times(engine: Any, dirs: dict[str, Path]) -> list[float]:
    """Milliseconds of each adapter's load into the registry (disk → checked host tensors)."""
    registry = engine.runner.loras
    out = []
    for name, path in dirs.items():
        t0 = time.perf_counter()
        registry.load(f"{name}-again", str(path))
        out.append((time.perf_counter() - t0) * 1e3)
        registry.unload(f"{name}-again")
    return out


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_start = [round(x, 2) for x in os.getloadavg()]
    model_dir = write_tiny_model(ROOT / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as tmp:
        dirs = {s.name: write_adapter(model_dir, Path(tmp) / s.name, s) for s in adapter_specs()}
        base = make_engine(model_dir, args, [])
        mixed = make_engine(model_dir, args, [(n, str(p)) for n, p in dirs.items()])
        prompts = workload(args, base.vocab_size)
        names = list(dirs)
        run(base, prompts[:2], 2, None, "warm")  # first-step costs out of the rounds
        run(mixed, prompts[:NUM_ADAPTERS], 2, names, "warm")
        arms: dict[str, list[tuple[float, float]]] = {"base": [], "mixed": []}
        for r in range(args.rounds):
            arms["base"].append(run(base, prompts, args.output_len, None, f"b{r}"))
            arms["mixed"].append(run(mixed, prompts, args.output_len, names, f"m{r}"))
        loads = load_times(mixed, dirs)
        adapter_mb = sum(f.stat().st_size for d in dirs.values() for f in d.iterdir()) / 2**20
    best = {arm: max(v[0] for v in runs) for arm, runs in arms.items()}
    best_cpu = {arm: max(v[1] for v in runs) for arm, runs in arms.items()}
    result: dict[str, Any] = {
        "base_tok_s": best["base"],
        "mixed_tok_s": best["mixed"],
        "ratio": best["mixed"] / best["base"],
        "ratio_cpu": best_cpu["mixed"] / best_cpu["base"],
        "goal_ratio": GOAL,
        "meets_goal": best["mixed"] / best["base"] >= GOAL,
        "adapters": NUM_ADAPTERS,
        "load_ms_median": statistics.median(loads),
        "load_ms_max": max(loads),
        "adapter_mb_mean": adapter_mb / NUM_ADAPTERS,
        "rounds": {arm: [round(v[0], 2) for v in runs] for arm, runs in arms.items()},
        "preset": args.preset,
        "requests": args.requests,
        "output_len": args.output_len,
        "threads": args.threads,
        **compare(requests=args.routing_requests, seed=args.seed),
        "load_avg_start": load_start,
        "load_avg_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
