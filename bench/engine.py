"""Engine throughput: pdserve's engine vs transformers' own continuous batching, in one run.

The same requests (random prompts, prompt lengths uniform 32–512, output lengths
uniform 16–256, ignore_eos) run through

* ours: every request added at once to ``LLMEngine`` (continuous batching, paged KV);
* baseline (``baseline_tok_s``, ``ratio``): transformers' continuous-batching manager
  (paged KV, requests admitted as others finish; bench/engine_baselines.py), every
  request added at once with its own output length, the same KV bytes, block size,
  token budget per step and request cap as ours;
* second row (``static_tok_s``, ``ratio_static``): ``model.generate()`` on static
  batches of 16 left-padded prompts, each batch run to its longest output,

on the ``small`` preset model, same dtype and threads, greedy. Output tokens/s counts the
tokens the requests asked for (the same total for all). Ratios are wall clock, with the
CPU-time ones beside (``*_cpu``). Also measured on ours: the
share of wall time outside the model forward (scheduling, input building, sampling,
detokenization, bookkeeping), the shares of attention (with its KV writes and, on the
gather path, the copies of pool blocks, also reported apart) and of the rest of the
forward (matmuls, norms, rotary embeddings), and the KV waste at peak (allocated slots not holding a
computed token / allocated slots, at the step with the most blocks allocated).
The last stdout line is JSON: ``{"ours_tok_s", "baseline_tok_s", "ratio", "static_tok_s",
"ratio_static", "overhead_share", "kv_waste", "threads", "load_avg_start", ...}``.

    python bench/engine.py            # 128 requests on the small model (minutes)
    python bench/engine.py --quick    # tiny model, 12 requests (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script
from lib import flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from engine_baselines import (
    CacheShape,
    Run,
    run_continuous,
    run_static,
    warm_up_continuous,
)
from tqdm import tqdm

from pdserve import env
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny model, few requests, seconds")
    p.add_argument("--preset", default="small")
    flags.add_ints(p, requests=128, prompt_len=(32, 512), output_len=(16, 256))
    p.add_argument("--batch", type=int, default=16, help="baseline static batch size")
    # One thread by default: on a shared, oversubscribed host, OpenMP threads wait on each
    # other at every op and both runs slow down many times over. Pass more on a quiet host.
    flags.add_ints(p, threads=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    flags.add_ints(p, kv_cache_bytes=1 << 30, max_num_batched_tokens=2048, seed=0)
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "gather"],
        help="auto: the CPU kernel where it builds; gather: the reference",
    )
    p.add_argument("--skip-baseline", action="store_true", help="profile ours only")
    p.add_argument("--skip-static", action="store_true", help="no static-batch row")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="ours without torch.compile (or PDSERVE_ENFORCE_EAGER=1)",
    )
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "engine.png"))
    args = p.parse_args()
    if args.quick:
        args.preset, args.requests, args.batch = "tiny", 12, 4
        args.prompt_len, args.output_len = [8, 64], [4, 24]
        args.kv_cache_bytes = 64 << 20
    return args


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    prompts, outs = [], []
    for _ in range(args.requests):
        n = rng.randint(*args.prompt_len)
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
        outs.append(rng.randint(*args.output_len))
    return Workload(prompts, outs)


def _timed(fn: Any, run: Run, field: str) -> Any:
    """``fn``, adding the seconds of each call to ``run``'s ``field``."""

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            setattr(run, field, getattr(run, field) + time.perf_counter() - t0)

    return wrapper


def _time_attention(run: Run) -> Any:
    """Time attention (and the gather path's KV copies) inside the forward; returns an undo."""
    from pdserve.engine import attention

    # _attend is what both the eager function and the compiled graph's opaque operator
    # call at run time: timing it changes no graph.
    fn, gather = attention._attend, attention._gather
    timed_attention = _timed(fn, run, "attention_seconds")
    timed_gather = _timed(gather, run, "kv_copy_seconds")
    attention._attend = timed_attention  # type: ignore[assignment]
    attention._gather = timed_gather  # type: ignore[assignment]

    def undo() -> None:
        attention._attend = fn  # type: ignore[assignment]
        attention._gather = gather  # type: ignore[assignment]

    return undo


def _kv_usage(engine: LLMEngine) -> tuple[int, int]:
    """(allocated slots, slots holding a computed token) over the owned blocks."""
    bs = engine.config.block_size
    owned = engine.kv.num_used_blocks
    live = sum(min(r.num_computed_tokens, len(r.block_ids) * bs) for r in engine.requests.values())
    return owned * bs, live


def run_ours(engine: LLMEngine, work: Workload) -> Run:
    run = Run()
    runner = engine.runner
    forward = runner.forward
    runner.forward = _timed(forward, run, "forward_seconds")
    undo = _time_attention(run)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens
    ]
    peak = (0, 0)
    done = 0
    bar = tqdm(total=work.output_tokens, desc="ours", unit="tok", file=sys.stderr)
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, (prompt, p) in enumerate(zip(work.prompts, params, strict=True)):
        engine.add_request(f"b{i}", prompt, p)
    while engine.has_work:
        outputs = engine.step()
        usage = _kv_usage(engine)
        if usage[0] > peak[0]:
            peak = usage
        n = sum(len(o.token_ids) for o in outputs)
        done += n
        bar.update(n)
        run.steps += 1
        run.timeline.append((time.perf_counter() - start, done))
    run.seconds = time.perf_counter() - start
    run.cpu_seconds = time.process_time() - cpu_start
    bar.close()
    runner.forward = forward
    undo()
    assert done == work.output_tokens, (done, work.output_tokens)
    assert engine.kv.all_free, "KV blocks leaked"
    run.kv_waste = 1 - peak[1] / peak[0] if peak[0] else 0.0
    return run


def plot(path: str, ours: Run, bases: dict[str, Run], result: dict[str, Any], title: str) -> None:
    plt = figures.pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [1, 2]})
    runs = {"pdserve engine": ours, **{k: v for k, v in bases.items() if v.seconds == v.seconds}}
    colors = ["#2a9d8f", "#e76f51", "#8d99ae"]
    values = [result["ours_tok_s"], result["baseline_tok_s"], result["static_tok_s"]]
    names = [n.replace(" ", "\n", 1) for n in runs]
    bars = ax1.bar(names, values[: len(runs)], color=colors[: len(runs)])
    ax1.bar_label(bars, [f"{v:.0f}" for v in values[: len(runs)]])
    ax1.set_ylabel("output tokens / s (wall clock)")
    ax1.set_title(
        f"{result['ratio']:.2f}x transformers CB (wall), {result['ratio_cpu']:.2f}x "
        f"CPU; {result['ratio_static']:.2f}x static",
        fontsize=9,
    )
    for (name, run), color in zip(runs.items(), colors, strict=False):
        xs = [0.0] + [t for t, _ in run.timeline]
        ys = [0] + [n for _, n in run.timeline]
        ax2.step(xs, ys, where="post", label=name, color=color)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("output tokens finished")
    ax2.legend(loc="lower right")
    ax2.set_title(
        f"overhead outside forward {result['overhead_share']:.1%}, "
        f"KV waste at peak {result['kv_waste']:.1%}",
        fontsize=10,
    )
    fig.suptitle(title, fontsize=10)
    figures.save(fig, path, dpi=120)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    load_start = [round(x, 2) for x in os.getloadavg()]
    model_dir = write_tiny_model(ROOT / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=max(args.requests, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # random prompts share nothing; keep the runs alike
        compile=not (args.enforce_eager or env.eager_forced()),
    )
    engine = LLMEngine(config)
    if args.attention == "gather":
        engine.runner.use_kernel = False
    work = make_workload(args, engine.vocab_size)
    print(
        f"{args.requests} requests, {sum(map(len, work.prompts))} prompt tokens, "
        f"{work.output_tokens} output tokens; {args.preset} model, {args.dtype}, "
        f"{args.threads} threads, {engine.kv.num_blocks} KV blocks",
        file=sys.stderr,
    )
    _warm_up(engine)
    ours = run_ours(engine, work)
    result: dict[str, Any] = {
        "ours_tok_s": work.output_tokens / ours.seconds,
        "overhead_share": 1 - ours.forward_seconds / ours.seconds,
        # Inside the forward: attention with its KV writes (and copies), then the rest
        # (matmuls, norms, rotary embeddings).
        "attention_share": ours.attention_seconds / ours.seconds,
        "kv_copy_share": ours.kv_copy_seconds / ours.seconds,
        "matmul_rest_share": (ours.forward_seconds - ours.attention_seconds) / ours.seconds,
        "attention_path": "kernel" if engine.runner.use_kernel else "gather",
        "compiled": engine.runner.compiled,
        "kv_waste": ours.kv_waste,
        "ours_s": ours.seconds,
        "ours_steps": ours.steps,
        "preemptions": engine.stats().preemptions,
    }
    pad_id = int(engine.tokenizer.pad_token_id)
    shape = CacheShape(
        engine.config.block_size,
        args.kv_cache_bytes,
        args.max_num_batched_tokens,
        max(args.requests, 1),
    )
    del engine
    cb = static = Run(seconds=float("nan"), cpu_seconds=float("nan"))
    if not args.skip_baseline:
        hf_model = _hf_model(model_dir, args)
        warm_up_continuous(hf_model, shape)
        cb = run_continuous(hf_model, work.prompts, work.output_lens, shape)
        if not args.skip_static:
            static = run_static(
                hf_model, pad_id, work.prompts, work.output_lens, args.batch, args.device
            )
        del hf_model
    # Wall clock first; the same over this process's CPU time (robust to other load).
    for name, run in (("baseline", cb), ("static", static)):
        result[f"{name}_tok_s"] = work.output_tokens / run.seconds
        result[f"{name}_s"] = run.seconds
        result[f"{name}_cpu_tok_s"] = work.output_tokens / run.cpu_seconds
    result["baseline"] = "transformers continuous batching (generation/continuous_batching)"
    result["ratio"] = result["ours_tok_s"] / result["baseline_tok_s"]
    result["ours_cpu_tok_s"] = work.output_tokens / ours.cpu_seconds
    result["ratio_cpu"] = result["ours_cpu_tok_s"] / result["baseline_cpu_tok_s"]
    result["ratio_static"] = result["ours_tok_s"] / result["static_tok_s"]
    result["ratio_static_cpu"] = result["ours_cpu_tok_s"] / result["static_cpu_tok_s"]
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    for k, v in result.items():
        print(f"{k:>15}: {v}", file=sys.stderr)
    if not args.skip_baseline:
        title = (
            f"{args.requests} requests (prompts {args.prompt_len[0]}–{args.prompt_len[1]}, "
            f"outputs {args.output_len[0]}–{args.output_len[1]} tokens), {args.preset} model, "
            f"{args.dtype}, {args.threads} thread{'s' if args.threads > 1 else ''}"
        )
        plot(args.plot, ours, {"transformers CB": cb, "transformers static": static}, result, title)
    print(
        json.dumps(
            {
                **result,
                "requests": args.requests,
                "output_tokens": work.output_tokens,
                "quick": args.quick,
                "threads": args.threads,
                "torch_threads": torch.get_num_threads(),
                "dtype": args.dtype,
                "preset": args.preset,
                "load_avg_start": load_start,
                "load_avg_end": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )
    return 0


def _warm_up(engine: LLMEngine) -> None:
    """One short request, so both runs start with warm kernels and allocator."""
    engine.generate([[5] * 40], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def _hf_model(model_dir: Path, args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, args.dtype), local_files_only=True
    )
    model = model.to(args.device).eval()
    with torch.inference_mode():  # the same warm-up as ours
        model.generate(
            input_ids=torch.full((1, 40), 5, device=args.device),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return model


if __name__ == "__main__":
    sys.exit(main())
