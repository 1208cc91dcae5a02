"""Attention over the paged KV pool, registered with transformers.

transformers runs the model's own code (projections, rotary embeddings, MLPs)
and calls this function for attention. It writes the step's new K/V into the
pool at ``slot_mapping`` and attends over each sequence's blocks:

* on CPU (the kernel path), every token that attends to context in the pool —
  decodes and continuing prefill chunks alike — goes to one call of the C++
  kernel (``paged_attention.cpp``) per layer, which reads the blocks in place;
  a prefill chunk that starts its request attends to its own new K/V with SDPA;
* elsewhere (CUDA, or no compiler; also the tests' reference), the gather path:
  decodes in a few batched calls, one per group of similar context lengths, over
  block tables padded to the group's longest; a continuing chunk gathers its
  context blocks, causal with the chunk's offset into its context.

Gathers index whole blocks (``[num_blocks, block_size, kv_heads, head_dim]``
rows), and grouped-query heads are folded into the query length, so K/V are
never expanded per query head.

The step's metadata reaches this function through a thread-local set by the
model runner, so several engines can run in one process on their own threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pdserve.engine import cpu_kernel
from pdserve.engine.kv_pool import KVPool

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the flattened step
    num_tokens: int  # query tokens of the chunk
    # Context blocks up to the chunk's end, and the context length; None when the
    # chunk is its request's whole context so far (its own K/V are the context).
    block_table: torch.Tensor | None = None  # [blocks]
    context_len: int = 0
    causal_mask: torch.Tensor | None = None  # [q, ctx] bool, with block_table


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [S] positions of the decode tokens in the step
    block_table: torch.Tensor  # [S, W] padded with block 0
    mask: torch.Tensor  # [S, 1, 1, W * block_size] bool: slot holds context


@dataclass
class KernelTokens:
    """The step's tokens for the CPU kernel: each attends to its request's first
    ``ctx`` positions, whose blocks are row ``table`` of ``tables``."""

    rows: torch.Tensor  # [n] int32, the tokens' rows in the step
    table: torch.Tensor  # [n] int32
    ctx: torch.Tensor  # [n] int32
    tables: torch.Tensor  # [requests, W] int32, padded with block 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # Reused gather targets, [blocks, block_size, kv_heads, head_dim] each, as large as
    # the largest gather of the step: a fresh tensor per gather costs page faults.
    k_buffer: torch.Tensor | None = None
    v_buffer: torch.Tensor | None = None
    kernel: KernelTokens | None = None  # the CPU kernel's tokens (then decodes is empty)


class _Current(threading.local):
    pool: KVPool | None = None
    meta: AttentionMetadata | None = None


CURRENT = _Current()


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: object,
) -> tuple[torch.Tensor, None]:
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if torch.compiler.is_compiling():
        # Under torch.compile the step's metadata is not a graph input: the op is
        # opaque to the compiler and reads it from the thread-local at run time.
        return paged_attention_op(query, key, value, layer, scale), None
    return _attend(query, key, value, layer, scale), None


# Registered through torch.library's low-level API rather than ``custom_op``: the latter
# checks its outputs for aliasing in Python on every call (four calls a step per layer).
_LIB = torch.library.Library("pdserve", "DEF")
_LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling) -> Tensor"
)


def paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float
) -> torch.Tensor:
    """:func:`paged_attention` as an operator the compiler keeps whole ([1, T, Hq, D])."""
    return torch.ops.pdserve.paged_attention(query, key, value, layer, scaling)


def _attend_op(  # looks _attend up per call, so a profiler may wrap it
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float
) -> torch.Tensor:
    return _attend(query, key, value, layer, scaling)


_LIB.impl("paged_attention", _attend_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float
) -> torch.Tensor:
    _b, hq, t, d = query.shape
    return query.new_empty((1, t, hq, d))


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float
) -> torch.Tensor:
    pool, meta = CURRENT.pool, CURRENT.meta
    assert pool is not None and meta is not None, "paged attention called outside a step"
    k_cache, v_cache = pool.layer(layer)
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    v_cache.index_copy_(0, meta.slot_mapping, v_new)
    bs = pool.shape.block_size
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.kernel is not None:
        _run_kernel(q, k_cache, v_cache, out, meta.kernel, bs, scaling)
        if not meta.prefills:  # a step of decodes and continuing chunks: done
            return out.unsqueeze(0)
    k_blocks = k_cache.view(-1, bs, *k_cache.shape[1:])  # [num_blocks, bs, Hkv, D]
    v_blocks = v_cache.view(-1, bs, *v_cache.shape[1:])

    def gather(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = table.flatten()
        return _gather(k_blocks, flat, meta.k_buffer), _gather(v_blocks, flat, meta.v_buffer)

    for group in meta.decodes:
        k, v = gather(group.block_table)
        out[group.rows] = _decode(q[group.rows], k, v, group, scaling)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if chunk.block_table is None:
            k, v = k_new[rows], v_new[rows]
        else:
            k, v = gather(chunk.block_table)
            k = k.flatten(0, 1)[: chunk.context_len]
            v = v.flatten(0, 1)[: chunk.context_len]
        out[rows] = _prefill(q[rows], k, v, chunk.causal_mask, scaling)
    return out.unsqueeze(0)


def _run_kernel(
    q: torch.Tensor,  # [T, Hq, D], any strides over T and heads
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D] contiguous
    tokens: KernelTokens,
    block_size: int,
    scaling: float | None,
) -> None:
    lib = cpu_kernel.load()
    assert lib is not None, "kernel metadata built without the kernel"
    if q.stride(2) != 1:
        q = q.contiguous()
    _t, hq, d = q.shape
    rc = lib.pdserve_paged_attention(
        cpu_kernel.DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        tokens.tables.data_ptr(), tokens.tables.shape[1], tokens.rows.data_ptr(),
        tokens.table.data_ptr(), tokens.ctx.data_ptr(), tokens.rows.numel(), hq,
        k_cache.shape[1], d, block_size, d**-0.5 if scaling is None else scaling,
        torch.get_num_threads(),
    )  # fmt: skip
    assert rc == 0, f"paged attention kernel failed ({rc})"


def _gather(blocks: torch.Tensor, ids: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    if buffer is None:
        return blocks.index_select(0, ids)
    return torch.index_select(blocks, 0, ids, out=buffer[: ids.numel()])


def _decode(
    q: torch.Tensor,  # [S, Hq, D]
    k: torch.Tensor,  # [S * W, block_size, Hkv, D], the group's blocks in table order
    v: torch.Tensor,
    group: DecodeGroup,
    scaling: float | None,
) -> torch.Tensor:
    s, hq, d = q.shape
    hkv = k.shape[2]
    # Query heads sharing a KV head become that head's query "positions": [S, Hkv, G, D].
    qg = q.view(s, hkv, hq // hkv, d)
    k = k.view(s, -1, hkv, d).transpose(1, 2)  # [S, Hkv, C, D]
    v = v.view(s, -1, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scaling)
    return o.reshape(s, hq, d)


def _prefill(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [ctx, Hkv, D]
    v: torch.Tensor,
    causal_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=causal_mask,
        is_causal=causal_mask is None,
        scale=scaling,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
