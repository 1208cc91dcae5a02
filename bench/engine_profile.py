"""Where one engine step's CPU time goes, on the default model (or any): prefill and decode.

One ``LLMEngine`` on one torch thread (``--threads``), compiled as workers serve
(``--eager`` for transformers' own forward), ``--batch`` greedy requests of
``--prompt-len`` random token ids. The prefill steps, then ``--decode-steps`` decode steps
at ``--batch`` rows, are each timed in **CPU time of the engine thread**
(``time.thread_time``: on a loaded host wall time counts other processes' turns) and split
(``--eager --pack``: transformers' forward with the compiled path's linear layers, for a
host where compiling the model takes longer than the measurement):

* ``forward``: ``ModelRunner.execute`` (the model, logits of the sampled rows only, their
  float32 copy); inside it, by ``torch.profiler`` self CPU time: ``lm_head`` (the GEMM whose
  output is the vocabulary), ``linears`` (every other GEMM, packed or not),
  ``attention`` (``pdserve::paged_attention``), ``logits_copy`` (``aten::copy_``/``to``
  of [rows, vocab]), ``other_ops`` (norms, rotary, activations: inductor's fused kernels);
* ``sampler``: ``LLMEngine._sample`` (grammar masks, penalties, argmax or the draw);
* ``python``: the rest of the step (scheduling, input building, bookkeeping).

Shares are of the step's CPU time. Also: ``lm_head_alone_ms``, the model's own output
layer timed alone on [batch, hidden] (CPU time, median of 9), and the CPU's bfloat16
instructions (``/proc/cpuinfo``: avx512_bf16, amx_bf16). Last stdout line: JSON.

    python bench/engine_profile.py                         # SmolLM2-135M, float32
    python bench/engine_profile.py --dtype bfloat16
    python bench/engine_profile.py --quick                 # tiny preset, eager (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from serve_models import default_model_dir  # noqa: E402

from pdserve.engine import cpu_linear  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.tiny_model import write_tiny_model  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402

CATEGORIES = ("lm_head", "linears", "attention", "logits_copy", "other_ops")
# Leaf ops only (self time): transformers' linear -> matmul -> mm is counted once, at mm.
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_mkl_linear")
ATTENTION = ("pdserve::paged_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2), 'tiny' or a dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eager", action="store_true", help="transformers' forward, no compile")
    p.add_argument(
        "--pack",
        action="store_true",
        help="with --eager: the compiled path's linear layers (cpu_linear.prepare), unfused",
    )
    p.add_argument("--quick", action="store_true", help="tiny preset, eager, 4 requests")
    args = p.parse_args()
    if args.quick:
        args.model, args.eager, args.batch, args.prompt_len, args.decode_steps = (
            "tiny",
            True,
            4,
            32,
            4,
        )
    return args


def model_dir(name: str) -> str:
    if name == "default":
        return default_model_dir("float32")
    if name == "tiny":
        return str(write_tiny_model(ROOT / ".cache" / "models" / "tiny-seed0", "tiny"))
    return name


def bf16_instructions() -> list[str]:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile", "avx2")})


class Timed:
    """CPU time spent in ``obj.name`` (wrapped in place), per call."""

    def __init__(self, obj: Any, name: str) -> None:
        self.calls: list[float] = []
        inner = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.thread_time()
            try:
                return inner(*a, **kw)
            finally:
                self.calls.append(time.thread_time() - start)

        setattr(obj, name, wrapper)

    def take(self) -> float:
        total, self.calls = sum(self.calls), []
        return total


def classify(event: Any, vocab: int) -> str | None:
    name, shapes = event.key, event.input_shapes or []
    if name in ATTENTION:
        return "attention"
    if name in GEMMS:
        wide = any(s and (s[-1] == vocab or s[0] == vocab) for s in shapes[1:2])
        return "lm_head" if wide else "linears"
    if name in ("aten::copy_", "aten::_to_copy") and any(s and s[-1] == vocab for s in shapes):
        return "logits_copy"
    return None


def op_split(prof: Any, vocab: int) -> tuple[dict[str, float], list[list[Any]]]:
    """Self CPU seconds per category over the profiled steps, and the top ops by self time."""
    out: dict[str, float] = defaultdict(float)
    events = prof.key_averages(group_by_input_shape=True)
    for ev in events:
        cat = classify(ev, vocab)
        if cat is not None:
            out[cat] += ev.self_cpu_time_total / 1e6
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    top = [[e.key, str(e.input_shapes)[:60], round(e.self_cpu_time_total / 1e3, 2)] for e in ranked]
    return out, top


def run_phase(
    engine: LLMEngine, steps: int, timers: dict[str, Timed], vocab: int
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    step_cpu, fwd, smp = [], 0.0, 0.0
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            if not engine.has_work:
                break
            start = time.thread_time()
            engine.step()
            step_cpu.append(time.thread_time() - start)
            fwd += timers["forward"].take()
            smp += timers["sampler"].take()
    total = sum(step_cpu)
    ops, top = op_split(prof, vocab)
    ops["other_ops"] = max(0.0, fwd - sum(ops[c] for c in CATEGORIES if c != "other_ops"))
    share = {c: round(ops[c] / total, 3) for c in CATEGORIES}
    share.update(
        sampler=round(smp / total, 3), python=round(max(0.0, total - fwd - smp) / total, 3)
    )
    return {
        "steps": len(step_cpu),
        "step_cpu_ms_median": round(statistics.median(step_cpu) * 1e3, 2),
        "share": share,
        "top_ops_self_ms": top,
    }


def lm_head_alone(engine: LLMEngine, rows: int) -> float:
    head = engine.runner.model.get_output_embeddings()
    x = torch.randn(rows, head.in_features, dtype=engine.runner.dtype)
    times = []
    with torch.inference_mode():
        for _ in range(11):
            start = time.thread_time()
            head(x)
            times.append(time.thread_time() - start)
    return round(statistics.median(times[2:]) * 1e3, 2)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    config = EngineConfig(
        model=path,
        dtype=args.dtype,
        cpu_threads=args.threads,
        compile=not args.eager,
        enable_prefix_caching=False,
        kv_cache_bytes=256 << 20,
        max_num_batched_tokens=2048,
    )
    started = time.monotonic()
    engine = LLMEngine(config)
    layout = cpu_linear.prepare(engine.runner.model) if args.eager and args.pack else None
    load_s = time.monotonic() - started
    vocab = int(engine.vocab_size)
    timers = {"forward": Timed(engine.runner, "execute"), "sampler": Timed(engine, "_sample")}
    rng = random.Random(0)
    top = min(vocab, len(engine.tokenizer)) - 1
    params = SamplingParams(max_tokens=args.decode_steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randint(3, top) for _ in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    prefill_steps = -(-args.batch * args.prompt_len // config.max_num_batched_tokens)
    prefill = run_phase(engine, prefill_steps, timers, vocab)
    engine.step()  # the first decode step after the last chunk: shapes settle
    decode = run_phase(engine, args.decode_steps, timers, vocab)
    out = {
        "model": Path(path).name,
        "dtype": args.dtype,
        "compiled": not args.eager,
        "linear_layout": layout,
        "threads": args.threads,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "vocab": vocab,
        "cpu_bf16_instructions": bf16_instructions(),
        "load_s": round(load_s, 1),
        "prefill": prefill,
        "decode": decode,
        "lm_head_alone_ms": {
            "decode_rows": lm_head_alone(engine, args.batch),
            "one_row": lm_head_alone(engine, 1),
        },
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
