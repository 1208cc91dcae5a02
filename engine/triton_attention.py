"""Paged attention in Triton: every query token reads its request's blocks in the pool.

One kernel serves decodes and prefill chunks alike. The step's query tokens are cut
into *tiles*: up to ``BLOCK_Q`` consecutive tokens of one request (a decode is a tile
of one). A program takes one tile and one KV head; the query heads that share the KV
head (GQA) are folded into the tile's rows, so each K/V block is loaded once for all
of them::

    rows of a tile:  token 0: heads g0 g1 .. | token 1: g0 g1 .. | ...   (BLOCK_M rows)
    keys:            the request's positions [lo, ctx of the last token), block by block
                     through its row of the block table; causal (and windowed) per row

The new tokens' K/V are in the pool before the kernel runs, so a chunk that starts its
request, a continuing chunk and a decode differ only in their tiles. Options per layer:
a sliding window (key ``j`` is seen from position ``p`` when ``p - window < j <= p``, as
transformers masks it), logit soft-capping (``cap * tanh(s / cap)`` after scaling) and
attention sinks (one logit per query head that joins the softmax's denominator).

A head wider than ``NARROW_D`` (MLA's compressed latent, 512 + 64) would make a row's
tile too wide for a program's registers: ``_attention`` then cuts the head into
``CHUNK_D``-wide slices, sums q . k over them, and gives each program one output slice.

Triton's interpreter runs the same source on CPU tensors when ``TRITON_INTERPRET=1`` is
set before triton is first imported (triton.language's own helpers are decorated at
import); :func:`interpreted` says which mode this process got.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

NO_WINDOW = 1 << 30  # a window no context reaches: the mask's arithmetic stays branch-free
DECODE_ROWS = 16  # tl.dot's smallest M on GPUs
PREFILL_ROWS = 64  # rows of a prefill tile: BLOCK_Q tokens x the padded GQA group
NARROW_D = 256  # the widest head a row's whole tile takes (``_attention``)
CHUNK_D = 64  # a wide head's slice (``_attention``, ``CHUNKS > 1``): 576 = 9 x 64
MAX_HEAD_DIM = 1024  # the widest head the wide kernel is tried at


def interpreted() -> bool:
    """Whether triton runs kernels in its interpreter (numpy, CPU tensors) here."""
    return bool(triton.knobs.runtime.interpret)


def supports(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """The kernels' limits: power-of-two blocks of >= 16 tokens (tl.dot's smallest K),
    whole GQA groups, 16 <= head_dim <= ``MAX_HEAD_DIM``. A head up to ``NARROW_D`` wide
    runs in one tile per row; a wider one (compressed MLA at its real size: the latent's
    512 + 64) in ``CHUNK_D``-wide chunks (``_attention``'s ``CHUNKS > 1``), proved
    under the interpreter and compiled for sm_90 without spills, its GPU speed unmeasured.
    Wider than ``MAX_HEAD_DIM`` (no model known) takes the gather path rather than an
    untried width."""
    pow2 = block_size & (block_size - 1) == 0
    heads_ok = num_heads % num_kv_heads == 0 and 16 <= head_dim <= MAX_HEAD_DIM
    return pow2 and block_size >= 16 and heads_ok


@dataclass(frozen=True)
class Tiles:
    """One launch: tile ``i`` is ``count[i]`` tokens from step row ``row[i]`` on, the
    first of which attends to ``ctx[i]`` positions of block-table row ``table[i]``."""

    row: torch.Tensor  # [N] int32
    count: torch.Tensor  # [N] int32; 0 for a padding tile (a CUDA graph's spare slot)
    ctx: torch.Tensor  # [N] int32
    table: torch.Tensor  # [N] int32
    block_q: int  # most tokens in a tile (a constexpr of the kernel)


@dataclass(frozen=True)
class TritonMetadata:
    tables: torch.Tensor  # [requests, W] int32; entries past a request's blocks are never read
    launches: tuple[Tiles, ...]


def group_rows(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head, padded to a power of two (the kernel's BLOCK_G)."""
    return triton.next_power_of_2(num_heads // num_kv_heads)


def make_tiles(
    spans: Sequence[tuple[int, int, int, int]], block_q: int, device: torch.device
) -> Tiles:
    """Tiles of ``spans``: (first row in the step, tokens computed before it, tokens,
    block-table row) per request chunk."""
    cols: list[list[int]] = [[], [], [], []]
    for row, start, n, table in spans:
        for i in range(0, n, block_q):
            tile = (row + i, min(block_q, n - i), start + i + 1, table)
            for col, value in zip(cols, tile, strict=True):
                col.append(value)
    rows, count, ctx, tables = (torch.tensor(c, dtype=torch.int32, device=device) for c in cols)
    return Tiles(rows, count, ctx, tables, block_q)


def step_metadata(
    chunks: Sequence[tuple[int, int]],  # (tokens computed before, tokens) per request, in order
    block_lists: Sequence[Sequence[int]],  # each request's blocks, covering its chunk
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
) -> TritonMetadata:
    """Decodes go in tiles of one token, prefill chunks in tiles of ``PREFILL_ROWS`` rows."""
    width = max(map(len, block_lists))
    tables = torch.zeros((len(block_lists), width), dtype=torch.int32)
    for i, blocks in enumerate(block_lists):
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    decodes: list[tuple[int, int, int, int]] = []
    prefills: list[tuple[int, int, int, int]] = []
    row = 0
    for i, (start, n) in enumerate(chunks):
        (decodes if n == 1 else prefills).append((row, start, n, i))
        row += n
    block_q = max(1, PREFILL_ROWS // group_rows(num_heads, num_kv_heads))
    launches = []
    if decodes:
        launches.append(make_tiles(decodes, 1, device))
    if prefills:
        launches.append(make_tiles(prefills, block_q, device))
    return TritonMetadata(tables.to(device), tuple(launches))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D], last dim contiguous
    k_cache: torch.Tensor,  # [slots, Hkv, D], slot = block * block_size + offset
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D], written for every row a tile covers
    meta: TritonMetadata,
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] float32
    splits: int | None = None,  # decode tiles' context splits; None: by the table's width
) -> None:
    _t, hq, d = q.shape
    hkv = k_cache.shape[1]
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.stride() == v_cache.stride()
    block_g = group_rows(hq, hkv)
    wide = d > NARROW_D
    # A head wider than NARROW_D (MLA's latent) is cut into CHUNK_D-wide slices: the same
    # tiles, each program one slice of the output (grid axis 2: the decode split,
    # then the slice). A program's scores still cover the whole width: q . k summed over
    # the chunks, so every slice's program computes the same scores (the price of never
    # holding a full-width row: ``chunks`` times the q . k work, K read once per slice;
    # unmeasured on a GPU). A narrow head is one slice of the padded width.
    chunks = triton.cdiv(d, CHUNK_D) if wide else 1
    chunk_d = CHUNK_D if wide else max(16, triton.next_power_of_2(d))
    for tiles in meta.launches:
        n = tiles.row.numel()
        if n == 0:
            continue
        block_m = max(DECODE_ROWS, tiles.block_q * block_g)
        # Decodes split their context over several programs (few requests x KV heads
        # would leave most of a GPU idle), combined after; prefill tiles are many already.
        s = 1 if tiles.block_q > 1 else splits or decode_splits(meta.tables.shape[1])
        cols = chunks * chunk_d + 2  # a partial row: [acc (every slice) | m | l]
        part = (
            torch.empty((n * hkv * s * block_m, cols), dtype=torch.float32, device=q.device)
            if s > 1
            else out
        )
        consts = {
            "G": hq // hkv,
            "BLOCK_G": block_g,
            "BLOCK_Q": tiles.block_q,
            "BLOCK_M": block_m,
            "D": d,
            "CHUNK_D": chunk_d,
            "CHUNKS": chunks,
            "SPLITS": s,
        }
        _attention[(n, hkv, s * chunks)](
            q,
            k_cache,
            v_cache,
            out,
            part,
            meta.tables,
            tiles.row,
            tiles.count,
            tiles.ctx,
            tiles.table,
            sinks if sinks is not None else q,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            out.stride(0),
            out.stride(1),
            meta.tables.stride(0),
            scale,
            softcap or 1.0,
            window or NO_WINDOW,
            BLOCK_SIZE=block_size,
            HAS_SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            **({"num_warps": wide_warps(block_m)} if wide else {}),
            **consts,
        )
        if s > 1:
            _combine[(n, hkv, chunks)](
                out, part, tiles.row, tiles.count, out.stride(0), out.stride(1), **consts
            )


def wide_warps(block_m: int) -> int:
    """Warps of a wide-head ``_attention`` program: 8 from 64 rows on. Compiled for sm_90
    without a GPU (triton.compile to a GPUTarget, cuobjdump's resource usage), bfloat16,
    DeepSeek's 576: at 4 warps 128 rows (128 heads) spill 288-320 bytes a thread at 255
    registers and 64 rows spill 8; at 8 warps none spills (249-254 and 181 registers)."""
    return 8 if block_m >= 64 else 4


def decode_splits(table_width: int) -> int:
    """Programs per decode tile and KV head: one per 16 blocks of the longest context's
    table (256 tokens at block 16), at most 16. Fixed by the width, so a CUDA graph's
    static tables give every replay the same launch."""
    return max(1, min(16, table_width // 16))


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D], last dim contiguous
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; a negative slot (a CUDA graph's padding row) is skipped
) -> None:
    """The step's new K/V into the pool (``index_copy_`` cannot skip padding rows)."""
    t, hkv, d = key.shape
    if t == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(2) == 1
    assert k_cache.stride() == v_cache.stride()
    _store_kv[(t, hkv)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
    )


@triton.jit
def _store_kv(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_s,
    stride_sh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = (d < D) & (d + slot >= d)  # a vector mask (the interpreter refuses a scalar operand)
    dst = slot * stride_s + h * stride_sh + d
    k_src = t.to(tl.int64) * stride_kt + h * stride_kh + d
    v_src = t.to(tl.int64) * stride_vt + h * stride_vh + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + k_src, mask=ok), mask=ok)
    tl.store(vc_ptr + dst, tl.load(v_ptr + v_src, mask=ok), mask=ok)


@triton.jit
def _tanh(x):
    # tl has no tanh that the interpreter also runs; exp of a non-positive number never overflows.
    t = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -th, th)


@triton.jit
def _tile_rows(
    row_ptr,
    count_ptr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """This program's tile (grid axis 0) and KV head (axis 1): the tile's first step row
    and token count, and per row ``m`` of the tile its token ``qi``, its query head and
    whether it is a real row (not GQA padding, not past the tile's tokens)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(row_ptr + tile)
    count = tl.load(count_ptr + tile)
    m = tl.arange(0, BLOCK_M)
    qi = m // BLOCK_G  # the row's token in the tile
    head = kvh * G + m % BLOCK_G
    row_ok = (qi < count) & (m % BLOCK_G < G) & (qi < BLOCK_Q)
    return tile, kvh, row0, count, m, qi, head, row_ok


@triton.jit
def _softmax_start(
    sinks_ptr, head, row_ok, m, split, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr
):
    """The online softmax's running max and sum before the first key. A sink joins the
    softmax once: in the first split's partial sums, as max = sink, sum = 1."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        first = (m * 0 + split) == 0
        m_i = tl.where(first, sink, float("-inf"))
        l_i = tl.where(first, 1.0, 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _split_blocks(ctx0, count, window, split, BLOCK_SIZE: tl.constexpr, SPLITS: tl.constexpr):
    """The keys the tile sees, ``[0, hi)`` (those of its last token), and the block-table
    entries ``[start, stop)`` that this split walks (from the first token's earliest key)."""
    hi = ctx0 + count - 1
    lo = tl.maximum(ctx0 - window, 0)
    b_lo = lo // BLOCK_SIZE
    b_hi = tl.cdiv(hi, BLOCK_SIZE)
    per = tl.cdiv(b_hi - b_lo, SPLITS)  # this split's share of the blocks
    return hi, b_lo + split * per, tl.minimum(b_lo + (split + 1) * per, b_hi)


@triton.jit
def _online_softmax(s, k_pos, q_pos, row_ok, window, softcap, m_i, l_i, HAS_SOFTCAP: tl.constexpr):
    """One block's scaled scores into the running softmax: soft-capped, masked to the keys
    each row sees (causal, windowed). Returns the block's probabilities, the factor that
    rescales what came before, and the new running max and sum."""
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(seen & row_ok[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _finish(
    acc,
    m_i,
    l_i,
    o_ptr,
    part_ptr,
    o_row,
    p_row,
    row_ok,
    d_out,
    out_ok,
    oc,
    WIDTH: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """The program's output slice ``d_out`` at rows ``o_row``: with one split normalised
    into ``o``, else its partials at rows ``p_row`` (``[acc (every slice, WIDTH) | m | l]``
    per row; m and l from slice 0's program), which ``_combine`` rescales to a common max."""
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ok = row_ok[:, None] & out_ok[None, :]
        tl.store(o_ptr + o_row + d_out[None, :], o.to(o_ptr.dtype.element_ty), mask=o_ok)
    else:
        p_off = p_row.to(tl.int64) * (WIDTH + 2)
        tl.store(part_ptr + p_off[:, None] + d_out[None, :], acc)
        slice0 = (p_row * 0 + oc) == 0  # a vector mask (the interpreter refuses a scalar one)
        tl.store(part_ptr + p_off + WIDTH, m_i, mask=slice0)
        tl.store(part_ptr + p_off + WIDTH + 1, l_i, mask=slice0)


@triton.jit
def _attention(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_ptr,
    tables_ptr,
    row_ptr,
    count_ptr,
    ctx_ptr,
    table_ptr,
    sinks_ptr,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_tab,
    scale,
    softcap,
    window,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    CHUNK_D: tl.constexpr,
    CHUNKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One tile at one KV head, its share ``split`` of the context. ``CHUNKS == 1`` (a
    head up to ``NARROW_D``, padded to ``CHUNK_D``): each row's whole query held, K and V
    of a block loaded together. Else the head is cut into ``CHUNKS`` slices of
    ``CHUNK_D``: the scores sum q . k slice by slice, and this program accumulates output
    slice ``oc`` only (grid axis 2: the split, then the slice)."""
    tile, kvh, row0, count, m, qi, head, row_ok = _tile_rows(
        row_ptr, count_ptr, G, BLOCK_G, BLOCK_Q, BLOCK_M
    )
    if CHUNKS == 1:
        split = tl.program_id(2)
        oc = 0
    else:
        split = tl.program_id(2) // CHUNKS
        oc = tl.program_id(2) % CHUNKS
    ctx0 = tl.load(ctx_ptr + tile)
    table = tl.load(table_ptr + tile).to(tl.int64)
    c = tl.arange(0, CHUNK_D)
    q_row = (row0 + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_pos = ctx0 - 1 + qi  # each row's position in its request
    d_out = oc * CHUNK_D + c  # this program's slice of the output
    out_ok = d_out < D
    if CHUNKS == 1:
        q_ok = row_ok[:, None] & out_ok[None, :]
        q = tl.load(q_ptr + (q_row + c[None, :]), mask=q_ok, other=0.0)

    m_i, l_i = _softmax_start(sinks_ptr, head, row_ok, m, split, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, CHUNK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_SIZE)
    hi, start, stop = _split_blocks(ctx0, count, window, split, BLOCK_SIZE, SPLITS)
    for blk in range(start, stop):
        block = tl.load(tables_ptr + table * stride_tab + blk).to(tl.int64)
        k_pos = blk * BLOCK_SIZE + n
        k_row = (block * BLOCK_SIZE + n)[:, None] * stride_ks + kvh * stride_kh
        k_live = (k_pos < hi)[:, None]
        if CHUNKS == 1:
            kv_off = k_row + c[None, :]  # one offset for K and V (whole rows)
            kv_ok = k_live & out_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        else:
            s = tl.zeros([BLOCK_M, BLOCK_SIZE], dtype=tl.float32)
            for w in range(CHUNKS):  # q . k over the whole width, one slice at a time
                dw = w * CHUNK_D + c
                dw_ok = (dw < D)[None, :]
                q_w = tl.load(q_ptr + q_row + dw[None, :], mask=row_ok[:, None] & dw_ok, other=0.0)
                k_w = tl.load(k_ptr + k_row + dw[None, :], mask=k_live & dw_ok, other=0.0)
                s += tl.dot(q_w, tl.trans(k_w), input_precision=PRECISION)
        p, alpha, m_i, l_i = _online_softmax(
            s * scale, k_pos, q_pos, row_ok, window, softcap, m_i, l_i, HAS_SOFTCAP
        )
        if CHUNKS > 1:
            v = tl.load(v_ptr + k_row + d_out[None, :], mask=k_live & out_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    o_row = (row0 + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    p_row = ((tile * tl.num_programs(1) + kvh) * SPLITS + split) * BLOCK_M + m
    width = CHUNKS * CHUNK_D
    _finish(acc, m_i, l_i, o_ptr, part_ptr, o_row, p_row, row_ok, d_out, out_ok, oc, width, SPLITS)


@triton.jit
def _combine(
    o_ptr,
    part_ptr,
    row_ptr,
    count_ptr,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    CHUNK_D: tl.constexpr,
    CHUNKS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One tile, KV head and output slice (grid axis 2; a narrow head is one slice): the
    splits' partial softmaxes rescaled to a common maximum."""
    tile, kvh, row0, _count, m, qi, head, row_ok = _tile_rows(
        row_ptr, count_ptr, G, BLOCK_G, BLOCK_Q, BLOCK_M
    )
    d = tl.arange(0, CHUNK_D)
    if CHUNKS > 1:  # grid axis 2: the output slice (one slice: the whole, padded head)
        d += tl.program_id(2) * CHUNK_D
    width = CHUNKS * CHUNK_D
    first = ((tile * tl.num_programs(1) + kvh) * SPLITS) * BLOCK_M + m
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(SPLITS):
        p_row = (first + s * BLOCK_M).to(tl.int64) * (width + 2)
        m_all = tl.maximum(m_all, tl.load(part_ptr + p_row + width))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, CHUNK_D], dtype=tl.float32)
    for s in range(SPLITS):
        p_row = (first + s * BLOCK_M).to(tl.int64) * (width + 2)
        w = tl.exp(tl.load(part_ptr + p_row + width) - m_safe)
        l_all += tl.load(part_ptr + p_row + width + 1) * w
        acc += tl.load(part_ptr + p_row[:, None] + d[None, :]) * w[:, None]
    o = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]
    o_off = (row0 + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    o_ok = row_ok[:, None] & (d < D)[None, :]
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=o_ok)
