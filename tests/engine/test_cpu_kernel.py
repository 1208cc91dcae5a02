"""The CPU paged-attention kernel against the gather path (the reference).

One step mixes decodes of different context lengths, a continuing prefill chunk
and a fresh prefill over a pool whose blocks are scattered; both paths run the
same attention call and must agree, in float32 and bfloat16, with and without
grouped-query heads, on one thread and two.
"""

from __future__ import annotations

import ctypes
import platform
import random

import pytest
import torch
from step_cases import BS, OneLayer, bare_runner, mixed_chunks

from pdserve.engine import attention as A
from pdserve.engine import attention_backends as ab
from pdserve.engine import cpu_kernel
from pdserve.engine.kv_pool import KVPool, KVShape
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_support import PLAIN, LayerAttention
from pdserve.engine.sched_output import ScheduledChunk

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(cpu_kernel.load() is None, reason="no C++ compiler here"),
]


def _attend(runner: ModelRunner, chunks: list[ScheduledChunk], q, k, v) -> torch.Tensor:  # type: ignore[no-untyped-def]
    _ids, _pos, slots, _rows = runner._flatten(chunks)
    A.CURRENT.pool, A.CURRENT.meta = runner.pool, runner._metadata(chunks, slots)
    try:
        out, _ = A.paged_attention(OneLayer(), q, k, v, None, scaling=q.shape[-1] ** -0.5)
    finally:
        A.CURRENT.pool = A.CURRENT.meta = None
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "threads"), [(4, 2, 32, 1), (8, 8, 64, 2), (6, 1, 16, 1)]
)
def test_kernel_matches_gather(dtype: torch.dtype, hq: int, hkv: int, d: int, threads: int) -> None:
    rng = random.Random(hq * 100 + d)
    torch.manual_seed(hq * 100 + d)
    shape = KVShape(1, hkv, d, BS, dtype)
    pools = [KVPool(shape, 64, torch.device("cpu")) for _ in range(2)]
    history = torch.randn(pools[0].tensor.shape).to(dtype)  # earlier steps' K/V
    chunks = mixed_chunks(rng, 64)
    t = sum(c.num_tokens for c in chunks)
    # A transposed query, as transformers hands it over: [1, Hq, T, D] over [T, Hq, D].
    q = torch.randn(1, t, hq, d).to(dtype).transpose(1, 2)
    k, v = torch.randn(1, hkv, t, d).to(dtype), torch.randn(1, hkv, t, d).to(dtype)
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for pool, kernel in zip(pools, (True, False), strict=True):
            pool.tensor.copy_(history)
            runner = bare_runner(pool, ab.CPU if kernel else ab.GATHER)
            meta = runner._metadata(chunks, runner._flatten(chunks)[2])
            assert (meta.kernel is not None) == kernel and (not meta.decodes) == kernel
            outs.append(_attend(runner, chunks, q, k, v).float())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(pools[0].tensor, pools[1].tensor)  # the same new K/V written
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)


def test_kernel_limits() -> None:
    assert cpu_kernel.supports(torch.float32, 32, 8, 128)
    assert not cpu_kernel.supports(torch.float16, 32, 8, 128)  # no fp16 path: gather
    assert not cpu_kernel.supports(torch.float32, 32, 2, 128)  # 16 query heads per KV head
    assert not cpu_kernel.supports(torch.float32, 4, 4, 512)


# --- the kernel alone, over raw pools, against float64 attention ------------------------
#
# Head dims / query-head groups chosen to reach every code path on an AVX-512 host: head
# dims of 2, 4, 8 vectors and G of 1, 2, 3, 4, 8 compiled as such (9 x 3 x 64: SmolLM2's
# shape); G = 5 and 3 vectors at run time; 24 and 8 go to the AVX2 path (not a multiple
# of 16), 12 to the portable 4-lane one, 6 to the 1-lane one. Block sizes smaller than,
# equal to and larger than a tile, and one that is not a power of two (tiles then span
# blocks).
SHAPES = [
    (4, 2, 32),
    (8, 4, 64),
    (8, 1, 128),
    (2, 2, 16),
    (6, 2, 48),
    (9, 3, 64),
    (10, 2, 32),
    (4, 1, 24),
    (2, 1, 8),
    (3, 1, 12),
    (2, 2, 6),
]
# Context lengths: 1-token, around block and tile edges, not multiples of the block
# size, and long ones.
CTX = [1, 2, 5, 15, 16, 17, 31, 33, 100, 257, 2048, 2500]


def _kernel(lib, q, k, v, tables, ctx, block_size: int, threads: int, layer=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The kernel's output through the engine's own call (attention._run_kernel), token i
    in row i of ``tables``; with ``layer`` (window, softcap, sinks or None; none of them
    off) the layer-options entry point."""
    assert lib is not None
    out = torch.empty_like(q)
    rows = torch.arange(q.shape[0], dtype=torch.int32)
    tokens = A.KernelTokens(rows, rows, torch.tensor(ctx, dtype=torch.int32), tables)
    opts, sinks = PLAIN, None
    if layer is not None:
        window, softcap, sinks = layer
        opts = LayerAttention(window or None, softcap or None, sinks is not None)
        assert not opts.plain, layer
    A._run_kernel(q, k, v, out, tokens, block_size, None, opts, sinks, threads)
    return out


def _reference(q, k, v, tables, ctx, block_size: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Attention of each token over its first ctx positions, in float64."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    outs = []
    for i, c in enumerate(ctx):
        j = torch.arange(c)
        slots = tables[i].long()[j // block_size] * block_size + j % block_size
        ks = k[slots].double().repeat_interleave(hq // hkv, dim=1)  # [c, Hq, D]
        vs = v[slots].double().repeat_interleave(hq // hkv, dim=1)
        w = torch.einsum("hd,chd->hc", q[i].double() * d**-0.5, ks).softmax(-1)
        outs.append(torch.einsum("hc,chd->hd", w, vs))
    return torch.stack(outs)


@pytest.mark.parametrize("block_size", [16, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv", "d"), SHAPES)
def test_kernel_matches_float64(
    hq: int, hkv: int, d: int, dtype: torch.dtype, block_size: int
) -> None:
    _check_float64(cpu_kernel.load(), hq, hkv, d, dtype, block_size)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
@pytest.mark.parametrize("arch", ["haswell", "x86-64"])
def test_kernel_other_hosts(arch: str) -> None:
    """The kernel as built on an AVX2-only host (haswell: no AVX-512) and on a bare
    x86-64 one (the portable lanes only), checked the same way: every shape, both dtypes."""
    cxx = cpu_kernel._compiler()
    assert cxx is not None
    flags = [f"-march={arch}" if f == "-march=native" else f for f in cpu_kernel.FLAGS]
    lib = ctypes.CDLL(str(cpu_kernel.build(cxx, flags=flags)))
    cpu_kernel.declare(lib)
    widths = {d: lib.pdserve_kernel_width(d) for _hq, _hkv, d in SHAPES}
    assert max(widths.values()) == (8 if arch == "haswell" else 4), widths
    for hq, hkv, d in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            _check_float64(lib, hq, hkv, d, dtype, 16)
    built = [width for width in (16, 8, 4, 1) if _check_exp(lib, width)]
    assert built == ([8, 4, 1] if arch == "haswell" else [4, 1])


def _check_float64(lib, hq: int, hkv: int, d: int, dtype: torch.dtype, block_size: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(hq * 1000 + d * 10 + block_size)
    ctx = CTX
    width = -(-max(ctx) // block_size)
    num_blocks = len(ctx) * width + 7
    # Every token's blocks are distinct and scattered: a shuffled pool, block 0 unused.
    blocks = torch.randperm(num_blocks - 1, generator=gen)[: len(ctx) * width] + 1
    tables = blocks.view(len(ctx), width).to(torch.int32)
    k = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_blocks * block_size, hkv, d, generator=gen).to(dtype)
    q = (2 * torch.randn(len(ctx), hq, d, generator=gen)).to(dtype)  # peaked and flat rows
    out = _kernel(lib, q, k, v, tables, ctx, block_size, 1)
    ref = _reference(q, k, v, tables, ctx, block_size)
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # The split over threads never changes a bit.
    assert torch.equal(_kernel(lib, q, k, v, tables, ctx, block_size, 2), out)


def test_kernel_width() -> None:
    """The lane width per head dim: the widest path whose vectors divide it."""
    lib = cpu_kernel.load()
    for d in (6, 12, 24, 32, 64, 128):
        width = lib.pdserve_kernel_width(d)
        assert width in (1, 4, 8, 16) and d % width == 0
    assert lib.pdserve_kernel_width(6) == 1 and lib.pdserve_kernel_width(12) == 4


@pytest.mark.parametrize("width", [16, 8, 4, 1])
def test_kernel_exp_accuracy(width: int) -> None:
    """The softmax's exp: within 2 ulp of exp(x) for every x >= -87.33 (where exp(x)
    is normal), 0 below it (exp(x) < 1.2e-38 there: absolute error smaller than that)
    and for -inf, NaN for NaN. Dense over [-87.33, 0] (what the softmax feeds it) and
    some way above."""
    if not _check_exp(cpu_kernel.load(), width):
        pytest.skip(f"no {width}-lane path built on this host")


def _check_exp(lib, width: int) -> bool:  # type: ignore[no-untyped-def]
    """False where the build has no path of that width."""
    import numpy as np

    x = np.concatenate(
        [
            np.linspace(-87.33, 0.0, 1_000_003, dtype=np.float32),
            np.linspace(0.0, 80.0, 10_001, dtype=np.float32),
            np.array([0.0, -0.0, -1e-30, 1e-30, -0.5, -0.6931472, -87.33, -87.3365], np.float32),
        ]
    )
    y = np.empty_like(x)
    rc = lib.pdserve_kernel_exp(width, x.ctypes.data, y.ctypes.data, x.size)
    if rc != 0:
        return False
    exact = np.exp(x.astype(np.float64))
    ulps = np.abs(y - exact) / np.spacing(exact.astype(np.float32))
    assert ulps.max() <= 2.0, (ulps.max(), x[ulps.argmax()])
    low = np.array([-87.34, -88.0, -100.0, -104.0, -1e30, -np.inf], np.float32)
    special = np.concatenate([low, np.array([np.nan], np.float32)])
    out = np.empty_like(special)
    lib.pdserve_kernel_exp(width, special.ctypes.data, out.ctypes.data, special.size)
    assert (out[:-1] == 0.0).all() and np.isnan(out[-1])
    assert (np.exp(low.astype(np.float64)) < 1.2e-38).all()
    return True


# --- one layer's options (pdserve_paged_attention_layer) against float64 ---------------
#
# Windows shorter than a tile, across block edges, longer than most contexts; a soft-cap
# small enough to change the softmax; sinks of either sign; all three at once.
OPTIONS = [
    (1, 0.0, False),
    (5, 0.0, False),
    (17, 0.0, False),
    (100, 0.0, False),
    (0, 2.0, False),
    (0, 0.0, True),
    (7, 3.0, True),
]


def _reference_options(q, k, v, tables, ctx, block_size: int, window: int, softcap: float, sinks):  # type: ignore[no-untyped-def]
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    outs = []
    for i, c in enumerate(ctx):
        j = torch.arange(max(0, c - window) if window else 0, c)
        slots = tables[i].long()[j // block_size] * block_size + j % block_size
        ks = k[slots].double().repeat_interleave(hq // hkv, dim=1)
        vs = v[slots].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,chd->hc", q[i].double() * d**-0.5, ks)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        w = s.softmax(-1)[:, : len(j)]
        outs.append(torch.einsum("hc,chd->hd", w, vs))
    return torch.stack(outs)


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 32), (3, 1, 12), (6, 2, 48)])
@pytest.mark.parametrize(("window", "softcap", "with_sinks"), OPTIONS)
def test_kernel_layer_options_match_float64(
    window: int, softcap: float, with_sinks: bool, hq: int, hkv: int, d: int, block_size: int
) -> None:
    lib = cpu_kernel.load()
    gen = torch.Generator().manual_seed(window * 7 + hq + block_size)
    ctx = CTX[:-2]  # up to 257: the windows start in every part of a block
    width = -(-max(ctx) // block_size)
    num_blocks = len(ctx) * width + 3
    blocks = torch.randperm(num_blocks - 1, generator=gen)[: len(ctx) * width] + 1
    tables = blocks.view(len(ctx), width).to(torch.int32)
    k = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    v = torch.randn(num_blocks * block_size, hkv, d, generator=gen)
    q = 2 * torch.randn(len(ctx), hq, d, generator=gen)
    sinks = 2 * torch.randn(hq, generator=gen) if with_sinks else None
    out = _kernel(lib, q, k, v, tables, ctx, block_size, 1, layer=(window, softcap, sinks))
    ref = _reference_options(q, k, v, tables, ctx, block_size, window, softcap, sinks)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    # The reference really depends on the options (a kernel ignoring them would fail).
    assert not torch.allclose(ref, _reference_options(q, k, v, tables, ctx, block_size, 0, 0, None))
