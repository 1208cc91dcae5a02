"""The P/D hand-off through real worker processes: a prefill worker -> KV hand-off
(NIXL) -> decode worker, over HTTP, for DeepSeek-V3 (MLA + MoE: its pool holds the
compressed latent, and the decode worker's transfer metric counts exactly the latent's
bytes of every handed-off block). The decode worker continues from KV it did not
compute and gives transformers' own greedy tokens.

Every served family goes through the same hand-off (the workers' own KVServer and
RemoteKVConnector over NIXL) in tests/engine/test_family_pd.py, in one process per
family at a tenth of the cost of two worker processes; this file keeps the worker
plumbing around it (HTTP, the engine core process, the metrics) on one family.

The prompts (37, 20 and 11 tokens, sent at once so the decode worker batches mixed
lengths) run across blocks. A refused family makes the worker exit at start with the
option's name.
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
# Every family goes through the in-process pair (tests/engine/test_family_pd.py); through
# worker processes, the one whose pool and transfer differ most: MLA's latent.
HANDOFF_FAMILIES = ["deepseek-v3"]
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
