"""MLA in its compressed form (engine/mla.py): the pool holds DeepSeek's latent
(``kv_lora_rank`` + the rope key: one head, one plane), not K and V per head, and greedy
output stays transformers' own, on the CPU kernel and on the gather path.

The figures of docs/models.md (KV bytes per token, expanded vs compressed) are the
tiny models' here; DeepSeek-V2-Lite's are computed from its config in the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import family_matrix as fm
import pytest
import torch
from family_matrix import generate, reference

from pdserve.engine import cpu_kernel, mla
from tests.model_families import BY_ID, Family

pytestmark = pytest.mark.unit

MLA_FAMILIES = ["deepseek-v2", "deepseek-v3"]


def _expected_bytes_per_token(model_dir: Path, latent: bool) -> int:
    """From the config, not from the engine: the latent, or K and V per head with V
    padded to K's size (the expanded form's pool)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    rope = c.qk_rope_head_dim
    per_layer = (
        c.kv_lora_rank + rope if latent else c.num_key_value_heads * 2 * (c.qk_nope_head_dim + rope)
    )
    return c.num_hidden_layers * per_layer * 4  # float32


@pytest.mark.parametrize("family_id", MLA_FAMILIES)
def test_pool_holds_the_latent(family_id: str, family_dir: Callable[[Family], Path]) -> None:
    model_dir = family_dir(BY_ID[family_id])
    engine = fm.engine(model_dir, kernel=True)
    runner = engine.runner
    assert runner.latent == mla.LatentLayout(kv_lora_rank=32, rope_dim=8)
    pool = engine.kv.tensor
    assert pool.shape[1] == 1 and pool.shape[-2:] == (1, 40)  # one plane, one latent head
    assert runner.kv_shape.bytes_per_token == _expected_bytes_per_token(model_dir, latent=True)
    # The cache views: one tensor is both the keys and the values.
    k_cache, v_cache = runner.pool.layer(0)  # type: ignore[union-attr]
    assert k_cache is v_cache


def test_latent_is_smaller_and_both_forms_match_transformers(
    family_dir: Callable[[Family], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The expanded form (what MLA code the engine does not know keeps) against the
    compressed one: same tokens as transformers, 4.8x the bytes per token here."""
    model_dir = family_dir(BY_ID["deepseek-v2"])
    expected = reference(model_dir)
    latent = fm.engine(model_dir, kernel=False)
    assert generate(latent) == expected
    monkeypatch.setattr(mla, "LATENT_CLASSES", ())
    expanded = fm.engine(model_dir, kernel=False)
    assert expanded.runner.latent is None and expanded.kv.tensor.shape[1] == 2
    assert generate(expanded) == expected
    before = expanded.runner.kv_shape.bytes_per_token
    after = latent.runner.kv_shape.bytes_per_token
    assert before == _expected_bytes_per_token(model_dir, latent=False) == 2 * 768
    assert after == 2 * 160 and before / after == 4.8


@pytest.mark.parametrize("broken", ["query", "output"])
def test_absorption_matters(
    broken: str,
    family_dir: Callable[[Family], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check can fail: with every head given head 0's W_UK (or W_UV), the tokens are
    no longer transformers'."""
    model_dir = family_dir(BY_ID["deepseek-v3"])
    expected = reference(model_dir)
    name = "pdserve_w_uk" if broken == "query" else "pdserve_w_uv"
    engine = fm.engine(model_dir, kernel=cpu_kernel.load() is not None)
    for m in engine.runner.model.modules():
        if getattr(m, mla.LATENT_FLAG, False):
            w = getattr(m, name)
            setattr(m, name, w[:1].expand_as(w).clone())
    assert generate(engine) != expected


def test_absorbed_attention_equals_expanded_on_one_layer(
    family_dir: Callable[[Family], Path],
) -> None:
    """One layer's numbers: ``q . W_UK c`` and ``W_UV (sum p c)`` against transformers'
    expanded K and V (the identity the compressed form rests on), to float32 rounding."""
    from transformers import AutoModelForCausalLM

    model_dir = family_dir(BY_ID["deepseek-v2"])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    attn = hf.model.layers[0].self_attn
    torch.manual_seed(0)
    t, h, rank = 7, attn.num_heads, attn.kv_lora_rank
    q = torch.randn(1, h, t, attn.qk_head_dim)
    latent = torch.randn(1, 1, t, rank)
    k_rot = torch.randn(1, 1, t, attn.qk_rope_head_dim)
    k, v = attn.expand_kv(latent, k_rot)  # the class's own expansion (before compress)
    scores = (q @ k.transpose(-1, -2)).softmax(-1)
    want = (scores @ v).transpose(1, 2)  # [1, T, H, v]
    mla._install(attn)
    key, _ = attn.expand_kv(latent, k_rot)
    q_abs = mla.absorb_query(attn, q)
    lat_scores = (q_abs @ key.transpose(-1, -2)).softmax(-1)
    got = mla.expand_output(attn, (lat_scores @ key).transpose(1, 2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepseek_v2_lite_bytes_per_token() -> None:
    """docs/models.md's figure for DeepSeek-V2-Lite's real shapes (its config.json's
    attention fields: 27 layers, 16 heads, kv_lora_rank 512, K 128 + 64, V 128), bfloat16:
    the model built on the meta device (no weights), compressed as the engine does."""
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from pdserve.engine.kv_pool import KVShape

    cfg = DeepseekV2Config(
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        hidden_size=2048,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=4,  # the MoE's size does not change the KV
        first_k_dense_replace=27,
        intermediate_size=64,
        vocab_size=64,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layout = mla.compress(model)
    assert layout == mla.LatentLayout(kv_lora_rank=512, rope_dim=64)
    after = KVShape(27, 1, layout.head_dim, 16, torch.bfloat16, planes=1).bytes_per_token
    before = KVShape(27, 16, 128 + 64, 16, torch.bfloat16).bytes_per_token  # V padded to K
    assert (before, after) == (331_776, 31_104)


def test_latent_blocks_come_back_from_the_host_tier(family_dir: Callable[[Family], Path]) -> None:
    """The one-plane block in a KV tier (engine/kv_tiers): a prefix evicted from the pool
    comes back from the host tier with the cold run's tokens, every block a hit."""
    from engine_helpers import assert_all_free
    from test_kv_tiers_engine import DOC, _evict_all, _run

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv_tiers.config import TierConfig
    from pdserve.engine.llm_engine import LLMEngine

    model_dir = family_dir(BY_ID["deepseek-v2"])
    block = 16 * 2 * 40 * 4  # block_size x layers x (rank + rope) x float32

    def engine(**kw: object) -> LLMEngine:
        cfg = EngineConfig(
            model=str(model_dir), dtype="float32", device="cpu", kv_cache_bytes=24 * block
        )
        return LLMEngine(EngineConfig(**{**cfg.__dict__, **kw}))

    cold = engine()
    assert cold.runner.kv_shape.bytes_per_block == block
    want, _ = _run(cold, "cold", DOC)
    tiered = engine(kv_tiers=TierConfig(host_bytes=8 << 20))
    assert _run(tiered, "a1", DOC)[0] == want
    _evict_all(tiered, seed=1)
    again, cached = _run(tiered, "a2", DOC)
    store = tiered.tier_store
    assert store is not None
    assert again == want and cached == 96 and store.stats.hits["host"] == 6
    # the latent blocks and each entry's header; an expanded block would be 24,576 bytes
    assert 6 * block <= store.stats.bytes_read["host"] < 6 * (block + 1024)
    assert_all_free(cold)
    assert_all_free(tiered)
    store.close()
