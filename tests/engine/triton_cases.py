"""The Triton kernel's cases against the gather reference; run as a script under the interpreter.

``python tests/engine/triton_cases.py`` (with ``TRITON_INTERPRET=1`` in its environment,
set before triton is imported) runs every case of :data:`CASES` and prints one JSON line:
case id -> largest absolute difference from :func:`reference`. test_triton_attention.py
runs :func:`kernel_errors` in a subprocess (through triton_engine_cases.py, one interpreter
child for both), so that process's triton mode never leaks into the suite's.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

BLOCK_SIZE = 16
NUM_BLOCKS = 160  # the pool: more blocks than the requests use, in random order


@dataclass(frozen=True)
class Case:
    gqa: int  # query heads per KV head
    chunks: tuple[tuple[int, int], ...]  # (tokens before, tokens) per request
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    kv_heads: int = 2
    head_dim: int = 16
    pad: int = 3  # extra block-table columns, filled with blocks of other requests
    splits: int | None = None  # decode context splits (None: by table width, 2 here)
    shared_kv: bool = False  # MLA: the value cache is the key cache (one latent plane)

    @property
    def id(self) -> str:
        kind = "decode" if all(n == 1 for _, n in self.chunks) else "mixed"
        opts = [f"w{self.window}"] if self.window else []
        opts += [f"cap{self.softcap:g}"] if self.softcap else []
        opts += ["sinks"] if self.sinks else []
        opts += [f"split{self.splits}"] if self.splits else []
        opts += ["latent"] if self.shared_kv else []
        return "-".join([kind, f"gqa{self.gqa}", f"d{self.head_dim}", *opts])


DECODES = ((0, 1), (15, 1), (16, 1), (599, 1), (230, 1), (47, 1))  # context lengths 1..600
MIXED = ((0, 37), (31, 1), (100, 70), (16, 16), (590, 10), (5, 1))  # chunks start and continue
# (window, softcap, sinks): none, each alone, all together.
OPTIONS = ((None, None, False), (64, None, False), (None, 5.0, False), (40, 30.0, True))
CASES = [
    Case(gqa, chunks, window, softcap, sinks=sinks)
    for gqa in (1, 2, 4)
    for chunks in (DECODES, MIXED)
    for window, softcap, sinks in OPTIONS
]
CASES.append(Case(2, MIXED, window=100, kv_heads=1, head_dim=40, pad=0))  # D not a power of two
# Decode contexts split over 1, 3, 4 and 16 programs (16: most splits of short contexts are
# empty), the sink counted once.
CASES += [
    Case(2, DECODES, 40, 30.0, sinks=True, splits=4),
    Case(4, MIXED, 64, splits=3),
    Case(1, DECODES, splits=16, sinks=True),
    Case(2, DECODES, softcap=5.0, splits=1),
]
# Heads wider than triton_attention.NARROW_D: the chunked-width kernel, on tiny contexts
# (the interpreter runs every slice's program). DeepSeek's latent (512 + 64 = 576, one KV
# head that is key and value, 16 query heads), decodes split and combined, and a step of
# prefill chunks beside decodes; then a width that is no multiple of the 64-wide slice,
# with every layer option, decodes split over 3 programs.
MLA_DECODES = ((0, 1), (20, 1), (47, 1))
MLA_MIXED = ((0, 21), (33, 1), (16, 12))
WIDE = [
    Case(16, MLA_DECODES, kv_heads=1, head_dim=576, pad=1, splits=2, shared_kv=True),
    Case(4, MLA_MIXED, kv_heads=1, head_dim=576, pad=1, shared_kv=True),
    Case(2, MLA_DECODES, 20, 30.0, sinks=True, kv_heads=2, head_dim=300, pad=1, splits=3),
]
CASES += WIDE


def make_inputs(case: Case, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    hq, hkv, d = case.gqa * case.kv_heads, case.kv_heads, case.head_dim
    pool = torch.randn((2, NUM_BLOCKS * BLOCK_SIZE, hkv, d), generator=gen)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    blocks = []
    for start, n in case.chunks:
        need = -(-(start + n) // BLOCK_SIZE)
        blocks.append([free.pop() for _ in range(need)])
    tokens = sum(n for _, n in case.chunks)
    q = torch.randn((tokens, hq, d), generator=gen)
    sinks = torch.randn((hq,), generator=gen) if case.sinks else None
    # Padding: each table row runs on with other requests' blocks (never to be read).
    padded = [b + [rng.choice(free) for _ in range(case.pad)] for b in blocks]
    return {"pool": pool, "blocks": blocks, "padded": padded, "q": q, "sinks": sinks}


def reference(case: Case, inputs: dict[str, Any], scale: float) -> torch.Tensor:
    """Gather each request's context out of the pool, then dense masked softmax."""
    pool, q, sinks = inputs["pool"], inputs["q"], inputs["sinks"]
    out = torch.empty_like(q)
    row = 0
    for (start, n), blocks in zip(case.chunks, inputs["blocks"], strict=True):
        ctx = start + n
        slots = (torch.tensor(blocks)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
        k = pool[0][slots[:ctx]].repeat_interleave(case.gqa, dim=1)  # [ctx, Hq, D]
        v = pool[0 if case.shared_kv else 1][slots[:ctx]].repeat_interleave(case.gqa, dim=1)
        qq = q[row : row + n]
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        if case.softcap:
            s = case.softcap * torch.tanh(s / case.softcap)
        q_pos = torch.arange(start, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        seen = k_pos <= q_pos
        if case.window:
            seen &= k_pos > q_pos - case.window
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(-1, n, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :ctx]
        out[row : row + n] = torch.einsum("hqk,khd->qhd", p, v)
        row += n
    return out


def run_case(case: Case, seed: int = 0) -> float:
    from pdserve.engine import triton_attention as ta

    inputs = make_inputs(case, seed)
    scale = case.head_dim**-0.5
    hq = case.gqa * case.kv_heads
    meta = ta.step_metadata(case.chunks, inputs["padded"], hq, case.kv_heads, torch.device("cpu"))
    pool = inputs["pool"]
    out = torch.full_like(inputs["q"], float("nan"))
    ta.paged_attention(
        inputs["q"],
        pool[0],
        pool[0 if case.shared_kv else 1],  # MLA: the very same tensor
        out,
        meta,
        BLOCK_SIZE,
        scale,
        window=case.window,
        softcap=case.softcap,
        sinks=inputs["sinks"],
        splits=case.splits,
    )
    return float((out - reference(case, inputs, scale)).abs().max())


def store_case() -> float:
    """New K/V land at their slots; rows with slot -1 (padding) write nothing."""
    from pdserve.engine import triton_attention as ta

    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn((2, 6, 2, 24), generator=gen)
    v = v.transpose(0, 1).contiguous().transpose(0, 1)  # strides unlike K's, as in a model
    k_cache, v_cache = torch.zeros((2, 64, 2, 24))
    slots = torch.tensor([5, 63, -1, 0, 17, -1])
    ta.store_kv(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros((2, 64, 2, 24))
    real = slots >= 0
    want_k[slots[real]], want_v[slots[real]] = k[real], v[real]
    return float(max((k_cache - want_k).abs().max(), (v_cache - want_v).abs().max()))


def skip_discarded_overflow_checks() -> None:
    """The interpreter works out triton's int32 overflow check for every integer add, sub
    and mul of a kernel (``sanitize_overflow``, on by default: casts to int64, the op again,
    two compares) and hands it to ``device_assert``, which drops it unless the launch runs
    with ``debug`` (never here, nor in the engine's GPU launches): about a third of the
    interpreter's time on these cases (cProfile of the graphs case: 68 of 205 s in
    ``binary_op_sanitize_overflow_impl``), for a result no one reads. Off only while
    ``debug`` is off, so every value the kernels compute and every assert they run stay."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def kernel_errors() -> dict[str, float]:
    """Case id -> largest difference from the reference, every case and ``store_kv``."""
    from pdserve.engine import triton_attention as ta

    assert ta.interpreted(), "set TRITON_INTERPRET=1 before triton is imported"
    skip_discarded_overflow_checks()
    errors = {case.id: run_case(case, seed) for seed, case in enumerate(CASES)}
    errors["store_kv"] = store_case()
    return errors


def main() -> int:
    print(json.dumps(kernel_errors()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
