"""Every model family the engine is tested on: one row each, a tiny random model built
from transformers' own config class (like vLLM's ``tests/models/registry.py``).

Each model has a few hundred thousand parameters: 4 query heads of 16 dims over 2 KV
heads (DeepSeek's MLA: 4 and 4, K of 16 + 8 dims, V of 16), 2 layers in every served
family (one of each kind where a family alternates sliding and global layers: each layer
is traced again by every compile of tests/engine/test_family_compiled.py), the
project's tiny tokenizer (3072 tokens). Sliding windows are 8 tokens, so the tests'
prompts (40+ tokens) run far past them. Weights are drawn with a large
``initializer_range`` so that logits are sharp: greedy tokens change from step to step
and near-ties between the top two tokens (where float32 summation order could flip a
token) are rare.

``docs/models.md`` lists the same families with the test ids that prove them; a row
added here is a row added there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW = 8  # sliding window of every windowed family, in tokens
SEED = 0

# Shared by every row (a row's ``kwargs`` override them).
BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
MLA = {
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}
GEMMA3 = {
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 24,
    "sliding_window_pattern": 2,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
    },
}


@dataclass(frozen=True)
class Family:
    id: str  # the test id (docs/models.md names it)
    config_class: str  # in transformers
    kwargs: dict[str, Any] = field(default_factory=dict)
    features: str = ""  # what the row exercises (docs/models.md's column)
    # None: served and token-identical; else a text the load-time refusal must contain.
    refused: str | None = None


FAMILIES: list[Family] = [
    Family("llama", "LlamaConfig", {}, "the baseline: RoPE, GQA, SwiGLU"),
    Family("mistral", "MistralConfig", {"sliding_window": WINDOW}, "sliding window, all layers"),
    Family(
        "mixtral",
        "MixtralConfig",
        {"sliding_window": WINDOW, **MOE},
        "MoE (4 experts, top 2), sliding window",
    ),
    Family("qwen2", "Qwen2Config", {"attention_bias": True}, "QKV bias"),
    Family(
        "qwen2-sliding",
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        "sliding window on the layers from max_window_layers on",
    ),
    Family("qwen3", "Qwen3Config", {}, "q/k norms"),
    Family(
        "qwen3-moe",
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        "MoE (4 experts, top 2), q/k norms",
    ),
    Family("gemma", "GemmaConfig", {"hidden_act": "gelu_pytorch_tanh"}, "GeGLU, scaled embeddings"),
    Family(
        "gemma2",
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
        "attention and final logit soft-capping, query_pre_attn_scalar, "
        "alternating sliding/global layers",
    ),
    Family(
        "gemma3-text",
        "Gemma3TextConfig",
        GEMMA3,
        "local/global layers with their own rope, q/k norms",
    ),
    Family(
        "gemma3-config-softcap",
        "Gemma3TextConfig",
        {**GEMMA3, "attn_logit_softcapping": 5.0},
        "attn_logit_softcapping in the config, never passed by Gemma 3's code: not applied",
    ),
    Family("phi3", "Phi3Config", {"sliding_window": WINDOW}, "fused QKV/gate-up, sliding window"),
    Family("olmo2", "Olmo2Config", {}, "q/k norms over all heads, post-norms"),
    Family(
        "granite",
        "GraniteConfig",
        {
            "attention_multiplier": 0.3,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "logits_scaling": 0.5,
        },
        "attention/embedding/residual/logit multipliers",
    ),
    Family(
        "starcoder2",
        "Starcoder2Config",
        {"sliding_window": WINDOW, "hidden_act": "gelu_pytorch_tanh"},
        "sliding window, LayerNorm, plain MLP with bias",
    ),
    Family(
        "gpt-neox",
        "GPTNeoXConfig",
        {"rotary_pct": 0.5, "initializer_range": 0.5},
        "partial rotary (half the head), parallel residual",
    ),
    Family(
        "gpt-oss",
        "GptOssConfig",
        {"sliding_window": WINDOW, **MOE, "intermediate_size": 32},
        "attention sinks, alternating sliding/global layers, MoE",
    ),
    Family(
        "deepseek-v2",
        "DeepseekV2Config",
        {**MLA, "n_group": 1, "topk_group": 1},
        "MLA (K of 24 dims, V of 16), MoE with a shared expert",
    ),
    Family(
        "deepseek-v3",
        "DeepseekV3Config",
        {**MLA, "q_lora_rank": 32, "n_group": 1, "topk_group": 1},
        "MLA with a low-rank query, MoE with a shared expert",
    ),
    Family(
        "phimoe",
        "PhimoeConfig",
        {"sliding_window": WINDOW, **MOE},
        "MoE (4 experts, top 2, sparsemixer routing), sliding window",
    ),
    Family(
        "cohere", "CohereConfig", {"logit_scale": 0.5}, "LayerNorm, parallel block, logit scale"
    ),
    Family(
        "cohere2",
        "Cohere2Config",
        {"sliding_window": WINDOW, "sliding_window_pattern": 2},
        "alternating sliding/global layers, the global ones without rope",
    ),
    Family(
        "exaone4",
        "Exaone4Config",
        {"sliding_window": WINDOW, "sliding_window_pattern": 2},
        "alternating sliding/global layers, q/k norms, post-norms",
    ),
    Family(
        "internlm3",
        "InternLM3Config",
        {"qkv_bias": True, "bias": True},
        "InternLM 3: biases on the attention projections",
    ),
    Family(
        "qwen2-moe",
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
        "MoE with a gated shared expert",
    ),
    # Refused at load, by name (the text each refusal must contain).
    Family("bloom", "BloomConfig", {"n_head": 4, "n_layer": 2}, "ALiBi", refused="ALiBi"),
    Family(
        "falcon-alibi",
        "FalconConfig",
        {"alibi": True, "num_kv_heads": 4, "new_decoder_architecture": False},
        "ALiBi",
        refused="ALiBi",
    ),
    Family(
        "gemma3-bidirectional",
        "Gemma3TextConfig",
        {"use_bidirectional_attention": True, "sliding_window": WINDOW},
        "bidirectional attention",
        refused="non-causal",
    ),
    Family(
        "llama4-chunked",
        "Llama4TextConfig",
        {"attention_chunk_size": WINDOW, "num_local_experts": 2, "intermediate_size_mlp": 128},
        "chunked local attention",
        refused="chunked local attention",
    ),
    Family(
        "llama-config-window",
        "LlamaConfig",
        {"sliding_window": WINDOW},
        "sliding_window in the config: transformers' cache windows, its mask does not",
        refused="config sliding_window=8 that transformers' KV cache applies",
    ),
    Family(
        "falcon",
        "FalconConfig",
        {"new_decoder_architecture": True, "num_kv_heads": 2, "alibi": False},
        "Falcon's new decoder architecture: its own attention (no AttentionInterface)",
        refused="attention outside transformers' AttentionInterface",
    ),
    Family(
        "falcon-h1",
        "FalconH1Config",
        {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8},
        "Falcon-H1: Mamba-2 mixers beside attention in every layer",
        refused="layer type 'hybrid'",
    ),
    Family(
        "qwen3-next",
        "Qwen3NextConfig",
        {"num_hidden_layers": 4, "num_experts": 2, "moe_intermediate_size": 32},
        "linear-attention (Gated DeltaNet) layers",
        refused="layer type 'linear_attention'",
    ),
]
BY_ID = {f.id: f for f in FAMILIES}
# Not a row of the matrix: DeepSeek-V3's MLA at its real latent width (kv_lora_rank 512 +
# rope 64 = 576, the pool's one head), the rest tiny; the Triton kernel's chunked-width
# form runs it (tests/engine/test_triton_attention.py, under the interpreter).
MLA_FULL_LATENT = Family(
    "deepseek-v3-latent576",
    "DeepseekV3Config",
    {**MLA, "q_lora_rank": 32, "n_group": 1, "topk_group": 1}
    | {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
    "MLA with DeepSeek's own latent width (512 + 64)",
)


def cached_family(family: Family, tokenizer_dir: Path) -> Path:
    """The family's model in the tests' model cache (git-ignored, shared by sessions)."""
    root = Path(__file__).resolve().parent.parent / ".cache" / "test-models"
    cache = Path(os.environ.get("PDSERVE_TEST_CACHE", root))
    return build_family(family, tokenizer_dir, cache / "families" / family.id)


def make_config(family: Family, vocab_size: int, special_ids: dict[str, int]) -> Any:
    import transformers

    cls = getattr(transformers, family.config_class)
    kwargs = {**BASE, **family.kwargs}
    if family.config_class == "GPTNeoXConfig":  # no GQA, no separate head_dim
        kwargs.pop("head_dim")
        kwargs.pop("num_key_value_heads")
    if family.config_class in ("BloomConfig", "FalconConfig"):  # their own names
        kwargs = {k: v for k, v in kwargs.items() if "key_value" not in k and k != "head_dim"}
    if "kv_lora_rank" in kwargs:  # MLA: the head sizes are qk_*_head_dim, v_head_dim
        kwargs.pop("head_dim")
    return cls(vocab_size=vocab_size, **special_ids, **kwargs)


def build_family(family: Family, tokenizer_dir: Path, out_dir: Path) -> Path:
    """Writes the family's tiny random model (with ``tokenizer_dir``'s tokenizer) to
    ``out_dir`` once; a complete directory carries ``family.json``, written last."""
    if _complete(out_dir, family):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = make_config(family, len(tokenizer), ids)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _sharpen(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "family.json").write_text(json.dumps(_identity(family)))
    _move_into_place(tmp, out_dir, family)
    return out_dir


def _complete(out_dir: Path, family: Family) -> bool:
    marker = out_dir / "family.json"
    try:
        return bool(json.loads(marker.read_text()) == _identity(family))
    except (OSError, ValueError):
        return False


def _move_into_place(tmp: Path, out_dir: Path, family: Family) -> None:
    """Safe against concurrent writers (the suite's two xdist workers, other sessions): a
    reader never sees a half-written or removed model, and a writer that lost the race
    keeps the winner's (equal) model."""
    try:
        if _complete(out_dir, family):
            return  # a concurrent writer finished first
        if out_dir.exists():  # an older model: aside in one rename, then removed
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-old-"))
            os.replace(out_dir, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not _complete(out_dir, family):  # lost the race to another writer: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sharpen(model: Any) -> None:
    """Larger random biases, norms and sinks than the init gives (zeros or ones), so each
    of them changes the output and a kernel that ignored one would be caught."""
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
            elif p.ndim == 1 and ("norm" in name or "layernorm" in name):
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
            elif p.ndim == 1 and name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _identity(family: Family) -> dict[str, Any]:
    import transformers

    return {
        "family": family.id,
        "config_class": family.config_class,
        "kwargs": family.kwargs,
        "base": BASE,
        "version": 2,  # of make_config / _sharpen: a change rebuilds the cache
        "seed": SEED,
        "transformers": transformers.__version__,
    }
