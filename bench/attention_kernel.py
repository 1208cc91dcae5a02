"""CPU paged-attention kernel: CPU time per layer call, new vs old kernel vs gather+SDPA.

Decode steps of the tiny and small presets' and SmolLM2's attention shapes (B decodes at
C tokens of context each, blocks of 16 scattered over the pool in shuffled order), float32
and bfloat16, one thread. Three implementations over the same inputs, run side by side:

* ``new``: ``pdserve/engine/paged_attention.cpp`` (what the engine runs);
* ``old``: ``bench/paged_attention_v1.cpp``, the kernel before the rewrite (same C ABI);
* ``ref``: the gather path, the blocks copied out with ``index_select`` then SDPA with
  the query heads folded per KV head (what attention.py does without the kernel).

Outputs are checked against each other before timing. Each call is timed by this
thread's CPU time (``time.thread_time``) over many repetitions, in rounds that
alternate the implementations; the best round counts (the host is shared and noisy).
The last stdout line is JSON: ``{"speedup_vs_old": {case: x}, "geomean_vs_old", ...}``.

    python bench/attention_kernel.py            # 24 cases
    python bench/attention_kernel.py --quick    # tiny preset, 16 x 256, a few seconds
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script
import torch
import torch.nn.functional as F
from lib import flags

from pdserve.engine import cpu_kernel

ROOT = Path(__file__).resolve().parent.parent

# query heads, KV heads, head dim; smollm2: SmolLM2-135M (3 query heads per KV head)
SHAPES = {"tiny": (4, 2, 32), "small": (8, 4, 64), "smollm2": (9, 3, 64)}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
BS = 16
# The flags the old kernel was built with (its reductions vectorise by reassociation).
FLAGS_V1 = [*cpu_kernel.FLAGS, "-fno-signed-zeros", "-fassociative-math"]


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny preset, 16 x 256 only")
    p.add_argument("--min-time", type=float, default=0.15, help="CPU seconds per timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "attention_kernel.png"))
    args = p.parse_args()
    if args.quick:
        args.min_time, args.rounds = 0.03, 2
    return args


@dataclass
class Case:
    name: str
    q: torch.Tensor  # [B, Hq, D]
    k: torch.Tensor  # [slots, Hkv, D], the layer's pool
    v: torch.Tensor
    tables: torch.Tensor  # [B, W] int32, shuffled block ids
    ctx: int

    @property
    def batch(self) -> int:
        return int(self.q.shape[0])


def make_case(shape: str, batch: int, ctx: int, dtype: str, seed: int = 0) -> Case:
    hq, hkv, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    width = -(-ctx // BS)
    blocks = torch.randperm(batch * width + 8, generator=gen)[: batch * width] + 1
    slots = (batch * width + 9) * BS  # block 0 and a few more unused, as in the pool
    k, v = (torch.randn(slots, hkv, d, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    q = torch.randn(batch, hq, d, generator=gen).to(DTYPES[dtype])
    tables = blocks.view(batch, width).to(torch.int32)
    return Case(f"{shape} {dtype} {batch}x{ctx}", q, k, v, tables, ctx)


def kernel_fn(lib: ctypes.CDLL, c: Case) -> Callable[[], torch.Tensor]:
    """One layer call of the kernel ``lib`` over case ``c`` (one thread)."""
    _b, hq, d = c.q.shape
    out = torch.empty_like(c.q)
    rows = torch.arange(c.batch, dtype=torch.int32)
    ctx = torch.full((c.batch,), c.ctx, dtype=torch.int32)
    code = cpu_kernel.DTYPE_CODES[c.q.dtype]

    def call() -> torch.Tensor:
        rc = lib.pdserve_paged_attention(
            code,
            c.q.data_ptr(),
            c.q.stride(0),
            c.q.stride(1),
            c.k.data_ptr(),
            c.v.data_ptr(),
            out.data_ptr(),
            c.tables.data_ptr(),
            c.tables.shape[1],
            rows.data_ptr(),
            rows.data_ptr(),
            ctx.data_ptr(),
            c.batch,
            hq,
            c.k.shape[1],
            d,
            BS,
            d**-0.5,
            1,
        )
        assert rc == 0, rc
        return out

    return call


def reference_fn(c: Case) -> Callable[[], torch.Tensor]:
    """The gather path: copy each request's blocks out, then SDPA, query heads folded."""
    b, hq, d = c.q.shape
    hkv = c.k.shape[1]
    k_blocks, v_blocks = (x.view(-1, BS, hkv, d) for x in (c.k, c.v))
    ids = c.tables.flatten().long()
    qg = c.q.view(b, hkv, hq // hkv, d)

    def call() -> torch.Tensor:
        k = k_blocks.index_select(0, ids).view(b, -1, hkv, d)[:, : c.ctx].transpose(1, 2)
        v = v_blocks.index_select(0, ids).view(b, -1, hkv, d)[:, : c.ctx].transpose(1, 2)
        return F.scaled_dot_product_attention(qg, k, v).reshape(b, hq, d)

    return call


def cpu_time_per_call(fn: Callable[[], Any], min_time: float) -> float:
    """Seconds of this thread's CPU time per call, over as many calls as fill min_time."""
    fn()
    reps, spent = 1, 0.0
    while True:
        t0 = time.thread_time()
        for _ in range(reps):
            fn()
        spent = time.thread_time() - t0
        if spent >= min_time:
            return spent / reps
        reps = max(reps * 2, int(reps * min_time / max(spent, 1e-6)) + 1)


def measure(c: Case, impls: dict[str, Callable[[], torch.Tensor]], args: Any) -> dict[str, float]:
    outs = {name: fn().float().clone() for name, fn in impls.items()}
    tol = 1e-5 if c.q.dtype == torch.float32 else 2e-2
    for name in ("new", "old"):
        torch.testing.assert_close(outs[name], outs["ref"], atol=tol, rtol=tol, msg=name)
    best = {name: math.inf for name in impls}
    for _ in range(args.rounds):  # alternate, so other load falls on all alike
        for name, fn in impls.items():
            best[name] = min(best[name], cpu_time_per_call(fn, args.min_time))
    return {name: t * 1e6 for name, t in best.items()}  # microseconds


def cases(quick: bool) -> list[tuple[str, int, int, str]]:
    if quick:
        return [("tiny", 16, 256, "f32"), ("tiny", 16, 256, "bf16")]
    return [(s, b, n, dt) for s in SHAPES for dt in DTYPES for b in (16, 64) for n in (256, 1024)]


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = figures.pyplot()
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.9), 4))
    xs = range(len(rows))
    for i, name in enumerate(("old", "ref", "new")):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r[name] for r in rows], 0.27, label=name)
    ax.set_xticks(list(xs), [r["case"] for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("CPU µs per layer call (1 thread)")
    ax.set_title("paged attention: new kernel vs old kernel vs gather+SDPA")
    ax.legend()
    figures.save(fig, path, dpi=110)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    cxx = cpu_kernel._compiler()
    new = cpu_kernel.load()
    assert cxx is not None and new is not None, "no C++ compiler: nothing to time"
    v1 = ROOT / "bench" / "paged_attention_v1.cpp"
    old = ctypes.CDLL(str(cpu_kernel.build(cxx, v1, [cpu_kernel.ABI_HEADER], FLAGS_V1)))
    cpu_kernel.declare(old)
    rows = []
    print(f"{'case':<22}{'old µs':>10}{'ref µs':>10}{'new µs':>10}{'vs old':>8}{'vs ref':>8}")
    for spec in cases(args.quick):
        c = make_case(*spec)
        impls = {"old": kernel_fn(old, c), "ref": reference_fn(c), "new": kernel_fn(new, c)}
        t = measure(c, impls, args)
        row = {"case": c.name, **t, "vs_old": t["old"] / t["new"], "vs_ref": t["ref"] / t["new"]}
        rows.append(row)
        print(
            f"{c.name:<22}{t['old']:>10.1f}{t['ref']:>10.1f}{t['new']:>10.1f}"
            f"{row['vs_old']:>7.2f}x{row['vs_ref']:>7.2f}x",
            flush=True,
        )
    plot(rows, args.plot)
    result = {
        "speedup_vs_old": {r["case"]: round(r["vs_old"], 2) for r in rows},
        "speedup_vs_ref": {r["case"]: round(r["vs_ref"], 2) for r in rows},
        "geomean_vs_old": round(geomean([r["vs_old"] for r in rows]), 2),
        "min_vs_old": round(min(r["vs_old"] for r in rows), 2),
        "geomean_vs_ref": round(geomean([r["vs_ref"] for r in rows]), 2),
        "lanes": {s: new.pdserve_kernel_width(d) for s, (_, _, d) in SHAPES.items()},
        "quick": args.quick,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
