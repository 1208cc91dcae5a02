"""Attention over the paged KV pool, registered with transformers.

transformers runs the model's own code (projections, rotary embeddings, MLPs)
and calls this function for attention. It writes the step's new K/V into the
pool at ``slot_mapping`` and attends over each sequence's blocks:

* decodes (one query token each) in one batched call over padded block tables;
* prefill chunks one call each, causal with the chunk's offset into its context.

The step's metadata reaches this function through a thread-local set by the
model runner, so several engines can run in one process on their own threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from pdserve.engine.kv_pool import KVPool

ATTN_IMPLEMENTATION = "pdserve_paged"


@dataclass
class PrefillChunk:
    start: int  # offset of the chunk's first token in the flattened step
    num_tokens: int  # query tokens of the chunk
    context_slots: torch.Tensor  # [ctx] slots of all tokens up to the chunk's end
    causal_mask: torch.Tensor | None  # [q, ctx] bool, None when the chunk is the whole context


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    decode_rows: torch.Tensor | None  # [S] positions of decode tokens in the step
    decode_slots: torch.Tensor | None  # [S, C] padded context slots
    decode_mask: torch.Tensor | None  # [S, 1, 1, C] bool
    prefills: list[PrefillChunk]


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
    pool, meta = CURRENT.pool, CURRENT.meta
    assert pool is not None and meta is not None, "paged attention called outside a step"
    k_cache, v_cache = pool.layer(module.layer_idx)  # type: ignore[arg-type]
    k_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        assert meta.decode_slots is not None
        qd = q[meta.decode_rows].unsqueeze(2)  # [S, Hq, 1, D]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [S, Hkv, C, D]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True
        )
        out[meta.decode_rows] = od.squeeze(2)
    for chunk in meta.prefills:
        qp = q[chunk.start : chunk.start + chunk.num_tokens].transpose(0, 1).unsqueeze(0)
        kp = k_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
        vp = v_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=chunk.causal_mask,
            is_causal=chunk.causal_mask is None,
            scale=scaling,
            enable_gqa=True,
        )
        out[chunk.start : chunk.start + chunk.num_tokens] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
