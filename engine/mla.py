"""MLA (DeepSeek-V2/V3 multi-head latent attention) in its compressed form.

transformers' DeepSeek attention computes, per token, the latent ``c_kv``
(``kv_lora_rank`` values, after ``kv_a_layernorm``) and one rotary key ``k_rot``
(``qk_rope_head_dim``) shared by all heads, then expands them per head through
``kv_b_proj`` (its ``expand_kv``) into K (nope + rope) and V, and calls the attention
interface with those. Stored that way the pool holds ``heads x (K + V)`` values per
token and layer; the latent needs ``kv_lora_rank + qk_rope_head_dim``.

Here each MLA layer's ``expand_kv`` is replaced (an instance attribute) so that the
attention function receives the latent itself as a single KV head,
``key = [c_kv | k_rot]`` (``[1, 1, T, rank + rope]``), and the attention absorbs the
up-projections, as DeepSeek's and vLLM's MLA kernels do. With ``kv_b_proj`` split per
head into ``W_UK [H, nope, rank]`` and ``W_UV [H, v, rank]``::

    q_nope . (W_UK c_kv) = (q_nope W_UK) . c_kv           (W_UK absorbed into the query)
    sum_j p_j (W_UV c_kv_j) = W_UV (sum_j p_j c_kv_j)     (W_UV applied after attention)

so the query becomes ``[q_nope W_UK | q_rot]`` (``rank + rope`` per head), attention is
multi-query over the latent (value = the same rows: the output's first ``rank`` values
are the latent sum, the rope part of it is dropped), and ``W_UV`` maps each head's
latent sum to its V size. The scale is the model's own (it passes ``scaling``): the dot
products are the same numbers, summed in another order.

The pool stores one plane per layer (``KVShape.planes == 1``): the key cache is also
the value cache. Prefill and decode both run the absorbed form.

Only the attention classes listed in ``LATENT_CLASSES`` are compressed (their forward
is known to pass ``cat(q_nope, q_rot)`` and ``expand_kv``'s outputs as written above);
any other MLA code keeps the expanded form, which is correct, only larger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

LATENT_CLASSES = ("DeepseekV2Attention", "DeepseekV3Attention")
LATENT_FLAG = "pdserve_latent"  # set on a compressed attention module


@dataclass(frozen=True)
class LatentLayout:
    """What the pool holds per token and layer under MLA: one head of ``head_dim``."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


def _mla_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "kv_lora_rank")]


def compress(model: torch.nn.Module) -> LatentLayout | None:
    """Switch every MLA attention module of ``model`` to the latent form; None (nothing
    changed) when the model has no MLA, or MLA code this module does not know."""
    modules = _mla_modules(model)
    if not modules:
        return None
    unknown = {type(m).__name__ for m in modules} - set(LATENT_CLASSES)
    if unknown:
        logger.info("MLA attention %s kept in its expanded form (not compressed)", unknown)
        return None
    layouts = {
        LatentLayout(int(m.kv_lora_rank), int(m.qk_rope_head_dim))  # type: ignore[arg-type]
        for m in modules
    }
    assert len(layouts) == 1, f"MLA layers of different shapes: {layouts}"
    for m in modules:
        _install(m)
    return layouts.pop()


def _latent_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand_kv``'s replacement: the latent as one KV head, ``[B, 1, T, rank + rope]``
    (the value is the same rows; the attention reads its first ``rank`` values)."""
    key = torch.cat((kv_nope, k_rot), dim=-1)
    return key, key


def _install(m: torch.nn.Module) -> None:
    heads, nope, v, rank = (
        int(m.num_heads),  # type: ignore[arg-type]
        int(m.qk_nope_head_dim),  # type: ignore[arg-type]
        int(m.v_head_dim),  # type: ignore[arg-type]
        int(m.kv_lora_rank),  # type: ignore[arg-type]
    )
    kv_b = m.kv_b_proj
    assert isinstance(kv_b, torch.nn.Linear) and kv_b.bias is None, "kv_b_proj: a plain Linear"
    w = kv_b.weight.detach().view(heads, nope + v, rank)
    # Own copies: the compiled path may repack kv_b_proj's weight (engine/compiled.py).
    m.register_buffer("pdserve_w_uk", w[:, :nope].clone(), persistent=False)  # [H, nope, rank]
    m.register_buffer("pdserve_w_uv", w[:, nope:].clone(), persistent=False)  # [H, v, rank]
    m.expand_kv = _latent_kv  # an instance attribute: shadows the class's method
    setattr(m, LATENT_FLAG, True)


def absorb_query(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, nope + rope]`` -> ``[1, H, T, rank + rope]``: W_UK absorbed."""
    w_uk = module.pdserve_w_uk  # [H, nope, rank]
    assert isinstance(w_uk, torch.Tensor)
    nope = w_uk.shape[1]
    q_lat = torch.einsum("bhtn,hnr->bhtr", query[..., :nope], w_uk)
    return torch.cat((q_lat, query[..., nope:]), dim=-1)


def expand_output(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``[1, T, H, rank + rope]`` (the latent sums) -> ``[1, T, H, v]``: W_UV applied."""
    w_uv = module.pdserve_w_uv  # [H, v, rank]
    assert isinstance(w_uv, torch.Tensor)
    return torch.einsum("bthr,hvr->bthv", out[..., : w_uv.shape[2]], w_uv)
