"""The family matrix's shared pieces (tests/model_families.py's rows): the prompts every
served family runs, an engine on a family's model, its greedy tokens, and transformers'
own for the same prompts. test_model_families.py (eager, both attention paths),
test_family_compiled.py, test_family_pd.py and test_mla_latent.py run them; the
``family_dir`` and ``served`` fixtures (conftest.py) build each family's model once a
module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from engine_helpers import assert_all_free, family_config, run_requests

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from tests.model_families import FAMILIES, Family

SERVED = [f for f in FAMILIES if f.refused is None]
REFUSED = [f for f in FAMILIES if f.refused is not None]
MAX_TOKENS = 10
# Longer than the window (8) several times over, shorter than it, and one of a block
# and a half; a 32-token step budget splits the long ones into continuing chunks.
PROMPTS = [[(i * 37 + s) % 3000 + 5 for i in range(n)] for s, n in [(1, 45), (2, 24), (3, 5)]]


@dataclass(frozen=True)
class Served:
    """A served family's case: its model directory and transformers' greedy tokens."""

    family: Family
    model_dir: Path
    expected: list[list[int]]


def engine(model_dir: Path, kernel: bool) -> LLMEngine:
    e = LLMEngine(family_config(model_dir, max_num_batched_tokens=32))
    e.runner.use_kernel = kernel and e.runner.use_kernel
    return e


def generate(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = run_requests(engine, {str(i): (p, params) for i, p in enumerate(PROMPTS)})
    assert_all_free(engine)
    return [out[str(i)].token_ids for i in range(len(PROMPTS))]


def reference(model_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()
    return [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
