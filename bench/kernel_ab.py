"""Two builds of the CPU attention kernel in one engine: decode steps, swapped every two.

An A/B of a change to ``pdserve/engine/paged_attention.cpp`` on a real model, in one
process so both sides share the host's load: one ``LLMEngine`` (transformers' forward
with the compiled path's linear layers, ``--eager --pack`` in engine_profile's terms: no
compile wait), ``--batch`` greedy requests of ``--prompt-len`` random ids, then
``--steps`` decode steps at ``--batch`` rows, the kernel library switched between the
``--before`` source (e.g. main's file, ``git show main:engine/paged_attention.cpp``) and
this tree's every two steps. Each step is timed in CPU time of the engine thread
(``time.thread_time``), and inside it every kernel call (the kernel's outputs are
checked against float64 by tests/engine/test_cpu_kernel.py). Last stdout line: JSON, with
``step_after_over_before`` and ``kernel_after_over_before`` (medians).

    git show main:engine/paged_attention.cpp > /tmp/pa_before.cpp
    python bench/kernel_ab.py --before /tmp/pa_before.cpp          # SmolLM2, float32
    python bench/kernel_ab.py --before /tmp/pa_before.cpp --quick  # tiny preset
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from lib import flags
from serve_models import default_model_dir

from pdserve.engine import attention, cpu_kernel, cpu_linear
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> Any:
    p = flags.parser(__doc__, "tiny preset, 4 x 32, 8 steps")
    p.add_argument("--before", type=Path, required=True, help="the kernel source to compare")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    flags.add_ints(p, batch=16, prompt_len=256, steps=40)
    args = p.parse_args()
    if args.quick:
        args.batch, args.prompt_len, args.steps = 4, 32, 8
    return args


def build(source: Path) -> ctypes.CDLL:
    cxx = cpu_kernel._compiler()
    assert cxx is not None, "no C++ compiler: no kernel to compare"
    lib = ctypes.CDLL(str(cpu_kernel.build(cxx, source, cpu_kernel.HEADERS)))
    cpu_kernel.declare(lib)
    return lib


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    # The source includes its headers by name: stage it beside this tree's.
    staged = cpu_kernel.cache_dir() / "ab-before" / "paged_attention.cpp"
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.write_text(args.before.read_text())
    for header in cpu_kernel.HEADERS:
        (staged.parent / header.name).write_bytes(header.read_bytes())
    libs = {"before": build(staged), "after": build(cpu_kernel.SOURCE)}
    current = {"lib": libs["after"]}
    cpu_kernel.load = lambda: current["lib"]  # type: ignore[assignment]
    kernel_calls: list[float] = []
    inner = attention._run_kernel

    def timed(*a: Any, **kw: Any) -> None:
        start = time.thread_time()
        inner(*a, **kw)
        kernel_calls.append(time.thread_time() - start)

    attention._run_kernel = timed  # type: ignore[assignment]
    if args.quick:
        model = str(write_tiny_model(ROOT / ".cache" / "models" / "tiny-seed0", "tiny"))
    else:
        model = default_model_dir(args.dtype)
    config = EngineConfig(
        model=model,
        dtype=args.dtype,
        cpu_threads=1,
        compile=False,
        enable_prefix_caching=False,
        kv_cache_bytes=256 << 20,
        max_num_batched_tokens=2048,
    )
    engine = LLMEngine(config)
    cpu_linear.prepare(engine.runner.model)
    rng = random.Random(0)
    top = min(engine.vocab_size, len(engine.tokenizer)) - 1
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randint(3, top) for _ in range(args.prompt_len)], params)
    for _ in range(-(-args.batch * args.prompt_len // 2048) + 1):  # prefill, first decode
        engine.step()
    step: dict[str, list[float]] = {"before": [], "after": []}
    kernel: dict[str, list[float]] = {"before": [], "after": []}
    for i in range(args.steps):
        name = "before" if (i // 2) % 2 == 0 else "after"
        current["lib"] = libs[name]
        kernel_calls.clear()
        start = time.thread_time()
        engine.step()
        step[name].append(time.thread_time() - start)
        kernel[name].append(sum(kernel_calls))
    out: dict[str, Any] = {"model": Path(model).name, "dtype": args.dtype, "batch": args.batch}
    for name in ("before", "after"):
        out[name] = {
            "step_cpu_ms_median": round(statistics.median(step[name]) * 1e3, 2),
            "kernel_cpu_ms_median": round(statistics.median(kernel[name]) * 1e3, 2),
            "steps": len(step[name]),
        }
    for key in ("step", "kernel"):
        ratio = out["after"][f"{key}_cpu_ms_median"] / out["before"][f"{key}_cpu_ms_median"]
        out[f"{key}_after_over_before"] = round(ratio, 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
