"""Where one engine step's CPU time goes, on the default model (or any): prefill and decode.

One ``LLMEngine`` on one torch thread (``--threads``), compiled as workers serve
(``--eager`` for transformers' own forward), ``--batch`` greedy requests of
``--prompt-len`` random token ids. The prefill steps, then ``--decode-steps`` decode steps
at ``--batch`` rows, are each timed in **CPU time of the engine thread**
(``time.thread_time``: on a loaded host wall time counts other processes' turns) and split
(``--eager --pack``: transformers' forward with the compiled path's linear layers, for a
host where compiling the model takes longer than the measurement):

* ``forward``: ``ModelRunner.execute`` (the model, logits of the sampled rows only, their
  float32 copy); inside it, by forward hooks on the modules (CPU time): ``lm_head`` (the
  output layer), ``linears`` (every other linear layer, packed or not), ``attention`` (each
  layer's attention block less its projections: rotary, KV writes, the attention itself),
  ``other_ops`` (the rest of the forward: norms, MLP activations, embedding, glue);
* ``sampler``: ``LLMEngine._sample`` (grammar masks, penalties, argmax or the draw);
* ``python``: the rest of the step (scheduling, input building, bookkeeping).

The hooks see modules, so they run on the eager forward (``--eager``, with ``--pack`` the
compiled path's linear layouts); on the compiled forward they see nothing inside the graph
and ``other_ops`` holds the whole forward.
Shares are of the step's CPU time. Also: ``lm_head_alone_ms``, the model's own output
layer timed alone on [batch, hidden] (CPU time, median of 9), and the CPU's bfloat16
instructions (``/proc/cpuinfo``: avx512_bf16, amx_bf16). Last stdout line: JSON.

    python bench/engine_profile.py                         # SmolLM2-135M, float32
    python bench/engine_profile.py --dtype bfloat16
    python bench/engine_profile.py --quick                 # tiny preset, eager (seconds)
    python bench/engine_profile.py --model tiny --blas-call-macs 524288   # the old rule
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
from lib import flags
from serve_models import default_model_dir

from pdserve.engine import cpu_linear
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

CATEGORIES = ("lm_head", "linears", "attention", "other_ops", "logits_copy")


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny preset, eager, 4 requests")
    p.add_argument("--model", default="default", help="'default' (SmolLM2), 'tiny' or a dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    flags.add_ints(p, batch=16, prompt_len=256, decode_steps=16, threads=1)
    flags.add_options(
        p,
        eager=(False, "transformers' forward, no compile"),
        pack=(
            False,
            "with --eager: the compiled path's linear layers (cpu_linear.prepare), unfused",
        ),
        blas_call_macs=(
            cpu_linear.BLAS_CALL_MACS,
            "cpu_linear's bound for a small weight's BLAS calls (2^19: before 2026-12-07)",
        ),
        blas_only_elements=(
            cpu_linear.BLAS_ONLY_ELEMENTS,
            "cpu_linear's bound for float32 weights kept BLAS-only on an Intel CPU (0: every "
            "weight of 2^19 elements or more packed, as before 2026-12-07's fourth pass)",
        ),
    )
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


class ModuleClock:
    """CPU time inside modules, by forward hooks: the output head, every other linear
    layer, and each layer's attention block less the linears inside it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        head = model.get_output_embeddings()
        for name, module in model.named_modules():
            if module is head:
                self._watch(module, "lm_head")
            elif isinstance(module, (torch.nn.Linear, cpu_linear.PackedLinear)):
                self._watch(module, "linears")
                if ".self_attn." in f".{name}":
                    self._watch(module, "attention_linears")
            elif name.endswith("self_attn"):
                self._watch(module, "attention_block")

    def _watch(self, module: torch.nn.Module, key: str) -> None:
        started: list[float] = []
        module.register_forward_pre_hook(lambda *_: started.append(time.thread_time()))

        def done(*_: Any) -> None:
            self.spent[key] += time.thread_time() - started.pop()

        module.register_forward_hook(done)

    def take(self) -> dict[str, float]:
        got, self.spent = self.spent, defaultdict(float)
        got["attention"] = got.pop("attention_block", 0.0) - got.pop("attention_linears", 0.0)
        return got


def run_phase(engine: LLMEngine, steps: int, timers: dict[str, Timed]) -> dict[str, Any]:
    clock = ModuleClock(engine.runner.model)
    step_cpu, fwd, smp, parts = [], 0.0, 0.0, defaultdict(float)
    for timer in timers.values():  # calls before this phase
        timer.take()
    for _ in range(steps):
        if not engine.has_work:
            break
        start = time.thread_time()
        engine.step()
        step_cpu.append(time.thread_time() - start)
        fwd += timers["forward"].take()
        smp += timers["sampler"].take()
        for key, value in clock.take().items():
            parts[key] += value
    total = sum(step_cpu)
    parts["other_ops"] = max(0.0, fwd - parts["lm_head"] - parts["linears"] - parts["attention"])
    python = max(0.0, total - fwd - smp)
    share = {c: round(parts[c] / total, 3) for c in CATEGORIES if c != "logits_copy"}
    share.update(sampler=round(smp / total, 3), python=round(python / total, 3))
    return {
        "steps": len(step_cpu),
        "step_cpu_ms_median": round(statistics.median(step_cpu) * 1e3, 2),
        "python_ms_per_step": round(python / len(step_cpu) * 1e3, 2),
        "sampler_ms_per_step": round(smp / len(step_cpu) * 1e3, 3),
        "share": share,
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
    cpu_linear.BLAS_CALL_MACS = args.blas_call_macs
    cpu_linear.BLAS_ONLY_ELEMENTS = args.blas_only_elements
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
    prefill = run_phase(engine, prefill_steps, timers)
    engine.step()  # the first decode step after the last chunk: shapes settle
    decode = run_phase(engine, args.decode_steps, timers)
    out = {
        "model": Path(path).name,
        "dtype": args.dtype,
        "compiled": not args.eager,
        "linear_layout": layout,
        "blas_call_macs": args.blas_call_macs,
        "blas_only_elements": args.blas_only_elements,
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
