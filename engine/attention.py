"""Attention over the paged KV pool, registered with transformers.

transformers runs the model's own code (projections, rotary embeddings, MLPs)
and calls this function for attention. It writes the step's new K/V into the
pool at ``slot_mapping`` and attends over each sequence's blocks:

* on CPU (the kernel path), every token that attends to context in the pool —
  decodes and continuing prefill chunks alike — goes to one call of the C++
  kernel (``paged_attention.cpp``) per layer, which reads the blocks in place;
  a prefill chunk that starts its request attends to its own new K/V with SDPA;
* on CUDA, the Triton kernels (``triton_attention.py``): every token of the step,
  prefill or decode, in one or two launches per layer, reading the blocks in place;
* where neither runs (no compiler; also the tests' reference), the gather path:
  decodes in a few batched calls, one per group of similar context lengths, over
  block tables padded to the group's longest; a continuing chunk gathers its
  context blocks, causal with the chunk's offset into its context.

Each layer's options (``model_support.LayerAttention``: sliding window, logit
soft-cap, sinks) are honoured by both paths; the kernel takes them as arguments, the
gather path adds the window to its masks and computes soft-capped or sink attention
itself (SDPA has neither). Under MLA in transformers' expanded form (V narrower than K)
V is stored zero-padded to K's head size and the output cut back; DeepSeek-V2/V3 run
compressed (``mla.py``): the query absorbs ``W_UK``, key and value are one latent head
stored once (the pool's one plane), and ``W_UV`` maps the output back.

Gathers index whole blocks (``[num_blocks, block_size, kv_heads, head_dim]``
rows), and grouped-query heads are folded into the query length, so K/V are
never expanded per query head.

The step's metadata reaches this function through a thread-local set by the
model runner, so several engines can run in one process on their own threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pdserve.engine import attention_backends, cpu_kernel, gather_path, mla
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.model_support import PLAIN, LayerAttention, check_call

if TYPE_CHECKING:
    from pdserve.engine.triton_attention import TritonMetadata

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
    ctx: torch.Tensor | None = None  # [S, 1, 1, 1] context lengths (for windows)


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
    triton: TritonMetadata | None = None  # the Triton kernels' tiles (then nothing else is set)


class _Current(threading.local):
    pool: KVPool | None = None
    meta: AttentionMetadata | None = None
    # Set by the model runner: each layer's options and the architecture's name (for
    # refusals). Empty: every layer plain (the kernel tests call attention directly).
    layers: tuple[LayerAttention, ...] = ()
    architecture: str = "?"


def layer_options(layer: int) -> LayerAttention:
    layers = CURRENT.layers
    return layers[layer] if layers else PLAIN


CURRENT = _Current()


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    # Every option the call passes is honoured or refused by name (runs at trace time
    # under torch.compile, on every call otherwise: a few dict lookups).
    check_call(CURRENT.architecture, layer, layer_options(layer), {"dropout": dropout, **kwargs})
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    sinks = kwargs.get("s_aux")
    assert sinks is None or isinstance(sinks, torch.Tensor)
    latent = getattr(module, mla.LATENT_FLAG, False)
    if latent:  # MLA, compressed (engine/mla.py): key and value are the one latent head
        query = mla.absorb_query(module, query)
    if torch.compiler.is_compiling():
        # Under torch.compile the step's metadata is not a graph input: the op is
        # opaque to the compiler and reads it from the thread-local at run time. It keeps
        # the op whole ([1, T, Hq, Dv]).
        out = torch.ops.pdserve.paged_attention(query, key, value, layer, scale, sinks)
    else:
        out = _attend(query, key, value, layer, scale, sinks)
    return (mla.expand_output(module, out) if latent else out), None


# Registered through torch.library's low-level API rather than ``custom_op``: the latter
# checks its outputs for aliasing in Python on every call (four calls a step per layer).
_LIB = torch.library.Library("pdserve", "DEF")
_LIB.define(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scaling, "
    "Tensor? sinks) -> Tensor"
)


def _attend_op(*args: Any) -> torch.Tensor:  # looks _attend up per call (a profiler may wrap it)
    return _attend(*args)


_LIB.impl("paged_attention", _attend_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pdserve::paged_attention")
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_rest: Any) -> torch.Tensor:
    _b, hq, t, _d = query.shape
    return query.new_empty((1, t, hq, value.shape[-1]))


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scaling: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    pool, meta = CURRENT.pool, CURRENT.meta
    assert pool is not None and meta is not None, "paged attention called outside a step"
    opts = layer_options(layer)
    dv = value.shape[-1]
    if dv < key.shape[-1]:  # MLA: V stored zero-padded to K's size, output cut back
        value = F.pad(value, (0, key.shape[-1] - dv))
    k_cache, v_cache = pool.layer(layer)
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    bs = pool.shape.block_size
    if meta.triton is not None:  # writes the new K/V itself (skipping CUDA-graph padding)
        q, slots = query[0].transpose(0, 1), meta.slot_mapping
        o = attention_backends.run_triton(
            q, k_new, v_new, k_cache, v_cache, slots, meta.triton, bs, scaling, opts, sinks
        )
        return _cut(o, dv)
    k_cache.index_copy_(0, meta.slot_mapping, k_new)
    if v_cache is not k_cache:  # one plane under compressed MLA: the key rows are the values
        v_cache.index_copy_(0, meta.slot_mapping, v_new)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.kernel is not None:
        _run_kernel(q, k_cache, v_cache, out, meta.kernel, bs, scaling, opts, sinks)
        if not meta.prefills:  # a step of decodes and continuing chunks: done
            return _cut(out, dv)
    k_blocks = k_cache.view(-1, bs, *k_cache.shape[1:])  # [num_blocks, bs, Hkv, D]
    v_blocks = v_cache.view(-1, bs, *v_cache.shape[1:])

    def gather(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = table.flatten()
        k = _gather(k_blocks, flat, meta.k_buffer)
        return k, (k if v_cache is k_cache else _gather(v_blocks, flat, meta.v_buffer))

    for group in meta.decodes:
        k, v = gather(group.block_table)
        out[group.rows] = gather_path.decode(
            q[group.rows], k, v, group.mask, group.ctx, scaling, opts, sinks
        )
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if chunk.block_table is None:
            k, v = k_new[rows], v_new[rows]
        else:
            k, v = gather(chunk.block_table)
            k = k.flatten(0, 1)[: chunk.context_len]
            v = v.flatten(0, 1)[: chunk.context_len]
        mask = chunk.causal_mask
        if opts.window:
            ctx = chunk.num_tokens if chunk.block_table is None else chunk.context_len
            mask = gather_path.window_mask(chunk.num_tokens, ctx, opts.window, q.device)
        out[rows] = gather_path.prefill(q[rows], k, v, mask, scaling, opts, sinks)
    return _cut(out, dv)


def _cut(out: torch.Tensor, dv: int) -> torch.Tensor:
    """[T, Hq, D] -> [1, T, Hq, Dv] (D > Dv under MLA)."""
    if dv < out.shape[-1]:
        out = out[..., :dv].contiguous()
    return out.unsqueeze(0)


def _run_kernel(
    q: torch.Tensor,  # [T, Hq, D], any strides over T and heads
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, Hq, D] contiguous
    tokens: KernelTokens,
    block_size: int,
    scaling: float | None,
    opts: LayerAttention = PLAIN,
    sinks: torch.Tensor | None = None,
    threads: int | None = None,  # default: torch's intra-op threads
) -> None:
    lib = cpu_kernel.load()
    assert lib is not None, "kernel metadata built without the kernel"
    if q.stride(2) != 1:
        q = q.contiguous()
    _t, hq, d = q.shape
    scale = d**-0.5 if scaling is None else scaling
    args = (
        cpu_kernel.DTYPE_CODES[q.dtype],
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        tokens.tables.data_ptr(),
        tokens.tables.shape[1],
        tokens.rows.data_ptr(),
        tokens.table.data_ptr(),
        tokens.ctx.data_ptr(),
        tokens.rows.numel(),
        hq,
        k_cache.shape[1],
        d,
        block_size,
        scale,
    )
    threads = torch.get_num_threads() if threads is None else threads
    if opts.plain:
        rc = lib.pdserve_paged_attention(*args, threads)
    else:
        sink32 = None if sinks is None else sinks.detach().float().contiguous()
        rc = lib.pdserve_paged_attention_layer(
            *args,
            opts.window or 0,
            opts.softcap or 0.0,
            None if sink32 is None else sink32.data_ptr(),
            threads,
        )
    assert rc == 0, f"paged attention kernel failed ({rc})"


def _gather(blocks: torch.Tensor, ids: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    if buffer is None:
        return blocks.index_select(0, ids)
    return torch.index_select(blocks, 0, ids, out=buffer[: ids.numel()])


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
