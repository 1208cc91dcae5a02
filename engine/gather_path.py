"""The gather path's attention, over K/V gathered out of the pool (engine/attention.py).

The reference for the kernels, and the path where no kernel applies. A layer's options
(``model_support.LayerAttention``) are honoured here too: a sliding window narrows the
masks; soft-capped scores and sinks, which SDPA cannot do, go through :func:`eager`,
written as transformers' own eager attention computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.model_support import PLAIN, LayerAttention


def window_mask(num_tokens: int, ctx: int, window: int, device: torch.device) -> torch.Tensor:
    """[q, ctx] bool for the last ``num_tokens`` queries of ``ctx`` positions: causal, and
    query i sees keys j with i - j < ``window`` only."""
    q_pos = torch.arange(ctx - num_tokens, ctx, device=device)[:, None]
    dist = q_pos - torch.arange(ctx, device=device)[None, :]
    return (dist >= 0) & (dist < window)


def decode(
    q: torch.Tensor,  # [S, Hq, D]
    k: torch.Tensor,  # [S * W, block_size, Hkv, D], the group's blocks in table order
    v: torch.Tensor,
    mask: torch.Tensor,  # [S, 1, 1, W * block_size] bool: slot holds context
    ctx: torch.Tensor | None,  # [S, 1, 1, 1] context lengths (needed with a window)
    scaling: float | None,
    opts: LayerAttention = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    s, hq, d = q.shape
    hkv = k.shape[2]
    k = k.view(s, -1, hkv, d).transpose(1, 2)  # [S, Hkv, C, D]
    v = v.view(s, -1, hkv, d).transpose(1, 2)
    if opts.window:
        assert ctx is not None
        slot = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (slot >= ctx - opts.window)
    if not opts.plain:
        return eager(q.unsqueeze(2), k, v, mask, scaling, opts, sinks).reshape(s, hq, d)
    # Query heads sharing a KV head become that head's query "positions": [S, Hkv, G, D].
    qg = q.view(s, hkv, hq // hkv, d)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scaling)
    return o.reshape(s, hq, d)


def prefill(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [ctx, Hkv, D]
    v: torch.Tensor,
    causal_mask: torch.Tensor | None,
    scaling: float | None,
    opts: LayerAttention = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if opts.softcap is not None or opts.sinks:
        if causal_mask is None:
            n = q.shape[0]
            causal_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return eager(qt, kt, vt, causal_mask, scaling, opts, sinks)[0].transpose(0, 1)
    o = F.scaled_dot_product_attention(
        qt,
        kt,
        vt,
        attn_mask=causal_mask,
        is_causal=causal_mask is None,
        scale=scaling,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def eager(
    q: torch.Tensor,  # [B, Hq, L, D]
    k: torch.Tensor,  # [B, Hkv, C, D]
    v: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcast to [B, Hq, L, C]
    scaling: float | None,
    opts: LayerAttention,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with soft-capped scores and/or sinks, as transformers' eager code does it
    (SDPA has neither): scores, cap, mask, sink logit, softmax, the sink dropped."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (
        q.shape[-1] ** -0.5 if scaling is None else scaling
    )
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if opts.sinks:
        assert sinks is not None
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if opts.sinks:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v
