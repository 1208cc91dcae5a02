"""The draft-model proposer (``--speculative draft:model=PATH,k=N``): a small model with the
target's tokenizer drafts greedily, the target verifies in one forward.

Two drafts on the tiny target: the target itself (its drafts are nearly always accepted)
and a second random model with one layer and the same vocabulary (its drafts are mostly
rejected). Either way the greedy output is transformers' own, a seeded sampled request
draws what it draws without speculation, and every block of both the target's pool and
the draft's is free at the end. A draft with another vocabulary is refused by name.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, run_requests

from pdserve.engine.draft_proposer import DraftProposer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

PROMPTS = [
    [(i % 7) * 41 + 9 for i in range(45)],
    [(i * 13) % 997 + 5 for i in range(20)],
    [11, 12, 13],
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _random_model(src: Path, out: Path, seed: int, **config: Any) -> Path:
    """A random Llama with ``src``'s config overridden by ``config`` and its tokenizer."""
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(src, local_files_only=True)
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def small_draft(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_model(tiny_model_dir, tmp_path_factory.mktemp("draft"), 1, num_hidden_layers=1)


def _greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _draft_engine(engine: LLMEngine) -> DraftProposer:
    assert engine.spec is not None and isinstance(engine.spec.proposer, DraftProposer)
    return engine.spec.proposer


def _check_free(engine: LLMEngine) -> None:
    assert_all_free(engine)
    assert_all_free(_draft_engine(engine).engine)


@pytest.mark.parametrize("which", ["self", "small"])
def test_greedy_is_transformers_with_a_draft_model(
    make_engine: Callable[..., LLMEngine],
    hf_model: Any,
    tiny_model_dir: Path,
    small_draft: Path,
    which: str,
) -> None:
    draft = tiny_model_dir if which == "self" else small_draft
    engine = make_engine(speculative=f"draft:model={draft},k=3", max_num_batched_tokens=32)
    reqs = {str(i): (p, _greedy()) for i, p in enumerate(PROMPTS)}  # batched together
    got = run_requests(engine, reqs)
    for i, p in enumerate(PROMPTS):
        assert got[str(i)].token_ids == hf_greedy(hf_model, p, 16), i
    s = engine.spec.stats  # type: ignore[union-attr]
    assert s.draft_tokens > 0
    if which == "self":  # the target drafting for itself: (nearly) every draft accepted
        assert s.accepted_tokens >= 0.8 * s.draft_tokens
        assert s.emitted_tokens > 2 * s.steps
    _check_free(engine)


def test_seeded_sampling_draws_the_same_tokens(
    make_engine: Callable[..., LLMEngine], tiny_model_dir: Path
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    reqs = {"s": (PROMPTS[0], params)}
    plain = run_requests(make_engine(), reqs)
    engine = make_engine(speculative=f"draft:model={tiny_model_dir},k=4")
    got = run_requests(engine, reqs)
    assert got["s"].token_ids == plain["s"].token_ids
    # A random model's sampled tokens rarely match greedy drafts: rejections, then the
    # draw at the rejected row is the plain path's.
    assert engine.spec.stats.draft_tokens > 0  # type: ignore[union-attr]
    _check_free(engine)


def test_an_abort_frees_both_pools(
    make_engine: Callable[..., LLMEngine], tiny_model_dir: Path
) -> None:
    engine = make_engine(speculative=f"draft:model={tiny_model_dir},k=4")
    engine.add_request("a", PROMPTS[0], _greedy(40))
    for _ in range(4):
        engine.step()
    assert engine.spec.stats.steps > 0  # type: ignore[union-attr]
    engine.abort("a")
    _check_free(engine)


def test_a_draft_with_another_vocabulary_is_refused_by_name(
    make_engine: Callable[..., LLMEngine], tiny_model_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    other = _random_model(tiny_model_dir, tmp_path / "other", 2, vocab_size=vocab + 64)
    with pytest.raises(ValueError, match="vocab_size") as err:
        make_engine(speculative=f"draft:model={other},k=2")
    assert "speculative" in str(err.value) and str(other) in str(err.value)
    with pytest.raises(ValueError, match="not an HF model directory"):
        make_engine(speculative=f"draft:model={tmp_path / 'none'},k=2")


def test_a_failing_draft_step_costs_the_drafts_not_the_request(
    make_engine: Callable[..., LLMEngine], hf_model: Any, tiny_model_dir: Path
) -> None:
    engine = make_engine(speculative=f"draft:model={tiny_model_dir},k=3")
    draft = _draft_engine(engine).engine
    calls = {"n": 0}
    step = draft.step

    def flaky() -> Any:
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected draft fault")
        return step()

    draft.step = flaky  # type: ignore[method-assign]
    got = run_requests(engine, {"r": (PROMPTS[1], _greedy())})
    assert got["r"].token_ids == hf_greedy(hf_model, PROMPTS[1], 16)
    assert calls["n"] >= 3
    _check_free(engine)
