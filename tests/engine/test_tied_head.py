"""A model whose output head is tied to its input embedding (as SmolLM2's is), with the
compiled path's linear layers (cpu_linear.prepare: the head packed, few-row calls on the
shared tensor): float32 greedy stays token-identical to transformers.

Eager, with the layers prepared by hand (what the compiled forward multiplies by, without
a compile's minute). Six prompts: decode steps of six rows take the packed copy (more
than SHARED_ROWS rows, over SMALL_GEMM_MACS multiply-adds), the last prompt chunks one
row each take the shared tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_all_free, run_requests

from pdserve.engine import cpu_linear
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from tests.model_families import Family, cached_family

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

TIED = Family("llama-tied", "LlamaConfig", {"tie_word_embeddings": True}, "tied output head")
PROMPTS = [[(i * 37 + s) % 3000 + 5 for i in range(n)] for s, n in enumerate([45, 24, 5, 9, 17, 3])]
MAX_TOKENS = 10


@pytest.mark.skipif(
    not cpu_linear.onednn_usable(torch.float32), reason="torch built without oneDNN"
)
def test_tied_head_packed_is_token_identical_to_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = cached_family(TIED, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert all(len(set(e)) >= 4 for e in expected), expected  # weights that move
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=4 << 20,
        max_num_batched_tokens=64,
    )
    engine = LLMEngine(config)
    assert cpu_linear.prepare(engine.runner.model)["onednn_tied"] == 1
    head = engine.runner.model.get_output_embeddings()
    assert isinstance(head, cpu_linear.PackedLinear) and head.shared is not None
    embedding = engine.runner.model.get_input_embeddings().weight
    assert head.shared.data_ptr() == embedding.data_ptr()  # no second copy for lookups
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = run_requests(engine, {str(i): (p, params) for i, p in enumerate(PROMPTS)})
    assert_all_free(engine)
    assert [out[str(i)].token_ids for i in range(len(PROMPTS))] == expected
