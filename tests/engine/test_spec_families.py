"""Speculative decoding on every served model family: greedy output identical to
transformers' ``generate()``.

Each family's tiny random model (tests/model_families.py) decodes a repetitive prompt with
``--speculative ngram:k=4``; the proposer is spec_helpers.Oracle, drafting transformers'
own continuation with every third token wrong, so that every verification accepts some
drafts and rejects one, across sliding windows, soft-capping, sinks, MoE and MLA (random
models seldom repeat their context, so n-gram drafts alone would nearly all be rejected).
The plain path's identity with transformers is test_model_families.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import assert_all_free, family_config, run_requests
from spec_helpers import Oracle

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from tests.model_families import FAMILIES, Family, cached_family

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

SERVED = [f for f in FAMILIES if f.refused is None]
MAX_TOKENS = 14
PROMPT = [(i % 6) * 53 + 7 for i in range(30)]  # longer than the windows (8), repetitive


@pytest.mark.parametrize("family", SERVED, ids=[f.id for f in SERVED])
def test_family_speculative_matches_transformers(family: Family, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = cached_family(family, tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    expected = hf_greedy(hf, PROMPT, MAX_TOKENS)
    engine = LLMEngine(family_config(model_dir, speculative="ngram:k=4"))
    assert engine.spec is not None
    engine.spec.proposer = Oracle({tuple(PROMPT): expected})  # type: ignore[assignment]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = run_requests(engine, {"a": (PROMPT, params)})["a"].token_ids
    assert got == expected
    assert 0 < engine.spec.stats.accepted_tokens < engine.spec.stats.draft_tokens
    assert_all_free(engine)
