"""The attention options of tests/model_families.py through a real prefill worker ->
KV hand-off (NIXL) -> decode worker: the windowed + soft-capped (Gemma 2), the sink +
windowed + MoE (gpt-oss), the MLA + MoE (DeepSeek-V3, its pool holding the compressed
latent), the windowed MoE with its own
router (PhiMoE) and the shared-expert MoE (Qwen2-MoE) families give transformers' own
greedy tokens when the decode worker continues from KV it did not compute.

The prompts (37, 20 and 11 tokens, sent at once so the decode worker batches mixed
lengths) run past the 8-token windows and across blocks, so the handed-off blocks hold
positions some layers must no longer see and others must. A refused family makes
the worker exit at start with the option's name.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from worker_helpers import assert_all_free, handoff, metric, proc, worker_cluster

from pdserve.engine.model_support import head_dims
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.loopback import refused_start
from tests.model_families import BY_ID, cached_family

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

PROMPTS = [[(i * 53 + s) % 3000 + 5 for i in range(n)] for s, n in [(1, 37), (2, 20), (3, 11)]]
# One family per attention option (docs/models.md): window + soft-cap, sinks + window +
# MoE, MLA + MoE, window + a router the compiled path must leave alone, a shared expert.
HANDOFF_FAMILIES = ["gemma2", "gpt-oss", "deepseek-v3", "phimoe", "qwen2-moe"]
MAX_TOKENS = 8


@pytest.mark.parametrize("family_id", HANDOFF_FAMILIES)
def test_family_through_prefill_decode_handoff(
    family_id: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = cached_family(BY_ID[family_id], tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    c = hf.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_token = 2 * kv_heads * head_dims(c)[0]  # K and V per KV head
    if getattr(c, "kv_lora_rank", None):  # MLA, compressed: the latent and the rope key
        per_token = c.kv_lora_rank + c.qk_rope_head_dim  # 40 values, not 4 x 2 x 24
    block_bytes = c.num_hidden_layers * 16 * per_token * 4
    handed_off = 0

    with worker_cluster(model_dir, tmp_path, "nixl") as cluster:
        p_url, d_url = proc(cluster, "prefill").url, proc(cluster, "decode").url

        async def one(client: httpx.AsyncClient, i: int) -> list[int]:
            nonlocal handed_off
            tokens, blocks = await handoff(
                client, p_url, d_url, f"{family_id}-{i}", PROMPTS[i], MAX_TOKENS
            )
            assert blocks > 0
            handed_off += blocks
            return tokens

        async def run() -> list[list[int]]:
            async with httpx.AsyncClient() as client:  # at once: decode batches mixed lengths
                return list(await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS)))))

        assert asyncio.run(run()) == expected
        # The decode worker continued from KV it read, every handed-off block of it.
        moved = metric(d_url, "pdserve_kv_transfer_bytes_total", transport="nixl")
        assert moved == handed_off * block_bytes > 0
        assert_all_free(p_url, d_url)


def test_worker_refuses_an_unsupported_model_at_start(tiny_model_dir: Path) -> None:
    """A worker given a refused architecture exits at start, the option named in its
    output (here Qwen3-Next's linear-attention layers), instead of serving it."""
    model_dir = cached_family(BY_ID["qwen3-next"], tiny_model_dir)
    output = refused_start("prefill-worker", model_dir)
    assert (
        "Qwen3NextForCausalLM uses layer type 'linear_attention', which pdserve's paged "
        "attention does not implement" in output
    ), output[-2000:]
