"""How many threads a lone worker should take: measured on the model's own GEMMs at start-up.

A decode step is mostly the linear layers: every 2-D weight of the decoder plus the output
head, at the step's rows. Whether a second core pays depends on their shapes (wide
enough GEMMs gain more from another thread than OpenMP's barrier per op costs; narrow,
deep models and tiny ones do not), on the CPU, and on how busy its other cores are now,
not on a parameter count. So ``pdserve up`` times it: one pass over the model's weight
shapes (random weights of the served dtype, through the engine's own linear path,
``cpu_linear``) at ``ROWS`` rows, with one thread and with every core, interleaved,
median of a few passes each, in a child process (the ``up`` process never imports torch).
A lone worker takes every core when ``speedup = t(1) / t(all)`` is at least
``ALL_CORES_MIN_SPEEDUP``; otherwise it keeps one core free for the router and the
streaming path (see ``ClusterSpec.threads_per_worker``).

``ALL_CORES_MIN_SPEEDUP`` is a bound on the measured gain, not a size: a served step also
pays a barrier per op (norms, attention, sampling) and loses cycles to the HTTP loops that
share the cores, which the GEMM probe does not see, so a second thread must gain clearly
in the probe to gain at all served (quiet 2-core host, served: the ``small`` preset 1.38x
faster with two threads, the tiny one 0.8x). The probe's own values on a quiet host are
still to be recorded against those served outcomes; on this session's host, at load
average 15-20, it measured two threads 0.06-0.8x as fast as one for all four shapes of
bench/serve_models.py, and a lone worker kept one thread.

    python -m pdserve.local.thread_probe MODEL_DIR [--dtype float32] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

ALL_CORES_MIN_SPEEDUP = 1.4
ROWS = 16  # a decode batch at the concurrency the serving benchmark quotes
PASSES = 7  # per thread count; the median is kept
BUDGET_S = 3.0  # stop adding passes past this (a large model on a busy host)
HEAD_NAMES = ("lm_head", "embed_out")  # output heads; tied ones reuse the embedding
EMBED_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in")


def weight_shapes(model_dir: str) -> Counter[tuple[int, int]]:
    """(out, in) of every 2-D weight a step multiplies by, with counts: the decoder's
    linears and the output head (the embedding when the head is tied). Read from the
    safetensors headers; nothing is loaded."""
    from pdserve.local.processes import _safetensors_header

    shapes: Counter[tuple[int, int]] = Counter()
    embed: tuple[int, int] | None = None
    head = False
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, info in _safetensors_header(path).items():
            shape = info.get("shape") if isinstance(info, dict) else None
            if name == "__metadata__" or not shape or len(shape) != 2:
                continue
            if any(n in name for n in EMBED_NAMES):
                embed = (int(shape[0]), int(shape[1]))
                continue
            if "wpe" in name:  # position embeddings: looked up, not multiplied
                continue
            head = head or any(n in name for n in HEAD_NAMES)
            shapes[(int(shape[0]), int(shape[1]))] += 1
    if not head and embed is not None:
        shapes[embed] += 1
    return shapes


def _model_dtype(model_dir: str) -> str:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    got = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    return got if got in ("float32", "bfloat16", "float16") else "float32"


def measure(model_dir: str, dtype: str, threads: int) -> dict[str, Any]:
    """Seconds of one pass over the model's GEMMs at ``ROWS`` rows, 1 vs ``threads`` threads."""
    import torch

    from pdserve.engine import cpu_linear

    shapes = weight_shapes(model_dir)
    if not shapes:
        raise ValueError(f"{model_dir}: no 2-D weights in its safetensors files")
    torch_dtype = getattr(torch, _model_dtype(model_dir) if dtype == "auto" else dtype)
    layers = torch.nn.ModuleList()
    for out_features, in_features in shapes:
        layer = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch_dtype)
        layer.requires_grad_(False)
        layers.append(layer)
    cpu_linear.prepare(layers)
    counts = list(shapes.values())
    inputs = [torch.randn(ROWS, i, dtype=torch_dtype) for _, i in shapes]

    @torch.inference_mode()
    def one_pass(n: int) -> float:
        torch.set_num_threads(n)
        start = time.perf_counter()
        for layer, x, count in zip(layers, inputs, counts, strict=True):
            for _ in range(count):
                layer(x)
        return time.perf_counter() - start

    one_pass(1), one_pass(threads)  # oneDNN builds its primitives on the first calls
    single: list[float] = []
    multi: list[float] = []
    deadline = time.monotonic() + BUDGET_S
    while len(single) < PASSES and (len(single) < 3 or time.monotonic() < deadline):
        single.append(one_pass(1))  # interleaved: a burst of other load falls on both
        multi.append(one_pass(threads))
    t1, tn = statistics.median(single), statistics.median(multi)
    return {
        "threads": threads,
        "rows": ROWS,
        "t1_ms": round(t1 * 1e3, 3),
        "tn_ms": round(tn * 1e3, 3),
        "speedup": round(t1 / tn, 3),
        "passes": len(single),
        "weights": sum(counts),
    }


def takes_all_cores(result: dict[str, Any]) -> bool:
    return float(result.get("speedup", 0.0)) >= ALL_CORES_MIN_SPEEDUP


@lru_cache(maxsize=16)
def probe(model_dir: str, dtype: str, threads: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """``measure`` in a child process (once per model, dtype and core count in this process);
    ``{"error": ...}`` when it cannot run (no safetensors, no torch, a timeout)."""
    try:
        if not weight_shapes(model_dir):
            return {"error": f"{model_dir}: no 2-D weights in its safetensors files"}
    except (OSError, ValueError) as exc:
        return {"error": f"{model_dir}: {exc}"}
    argv = [
        sys.executable,
        "-m",
        "pdserve.local.thread_probe",
        model_dir,
        "--dtype",
        dtype,
        "--threads",
        str(threads),
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"thread probe took over {timeout_s:.0f}s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["thread probe failed"])[-1]}
    try:
        result = dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": f"thread probe printed no JSON: {done.stdout[-200:]!r}"}
    print(
        f"thread probe: {Path(model_dir).name} GEMMs at {result['rows']} rows "
        f"{result['t1_ms']} ms on 1 thread, {result['tn_ms']} ms on {threads}: "
        f"{result['speedup']}x -> a lone worker takes "
        f"{'every core' if result.get('all_cores') else 'all but one'}",
        file=sys.stderr,
        flush=True,
    )
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=0, help="the all-cores count (default: all)")
    args = p.parse_args()
    import os

    threads = args.threads or len(os.sched_getaffinity(0))
    try:
        result = measure(args.model_dir, args.dtype, threads)
    except (OSError, ValueError) as exc:
        print(f"thread probe: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({**result, "all_cores": takes_all_cores(result)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
