"""Speculative decoding in the engine: what it emits is what plain decoding emits.

Every test runs the same requests through an engine without speculation and one with it
(``--speculative ngram:k=4``, its proposer swapped for spec_helpers.Oracle so that drafts
are accepted and rejected on most steps), and compares what a caller sees: token ids,
text, finish reasons and logprobs. Greedy is compared with transformers too. The KV of
rejected drafts must not survive: blocks are trimmed after every step, the prefix cache's
blocks hold the same KV as the plain engine's, and every block is free at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, run_requests
from spec_helpers import Requests, outputs, with_oracle

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

SPEC = "ngram:k=4"
# Repetitive prompts of different lengths (more than a block, a block, a few tokens).
PROMPTS = [
    [(i % 7) * 41 + 9 for i in range(45)],
    [(i % 5) * 97 + 3 for i in range(16)],
    [11, 12, 13, 11, 12],
]


def greedy(n: int = 20, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _check_blocks(engine: LLMEngine) -> None:
    """After each step no decoding request keeps a block past its computed tokens' (+1)."""
    step = engine.step

    def checked() -> Any:
        outs = step()
        for req in engine.scheduler.running:
            if req.num_uncomputed_tokens == 1:
                assert len(req.block_ids) <= engine.kv.blocks_needed(req.num_tokens)
        return outs

    engine.step = checked  # type: ignore[method-assign]


def _both(make_engine: Callable[..., LLMEngine], reqs: Requests, **cfg: Any) -> tuple[Any, ...]:
    plain = make_engine(**cfg)
    ref = run_requests(plain, reqs)
    spec = make_engine(speculative=SPEC, **cfg)
    oracle = with_oracle(spec, ref, reqs)
    _check_blocks(spec)
    got = run_requests(spec, reqs)
    assert oracle.proposed > 0
    assert_all_free(plain)
    assert_all_free(spec)
    return plain, spec, ref, got


def test_greedy_identical_to_plain_and_transformers(
    make_engine: Callable[..., LLMEngine], hf_model: Any
) -> None:
    reqs = {str(i): (p, greedy()) for i, p in enumerate(PROMPTS)}
    # A 24-token budget mixes prompt chunks with speculative decodes in one step.
    plain, spec, ref, got = _both(make_engine, reqs, max_num_batched_tokens=24)
    assert outputs(got) == outputs(ref)
    for i, p in enumerate(PROMPTS):
        assert got[str(i)].token_ids == hf_greedy(hf_model, p, 20)
    s = spec.spec.stats
    assert 0 < s.accepted_tokens < s.draft_tokens  # drafts both accepted and rejected
    assert s.emitted_tokens > s.steps  # more than one token per verification
    assert max(r.num_deltas for r in got.values()) < 20  # several tokens per output
    # Blocks the prefix cache kept hold the same KV in both engines (no rejected draft's).
    both = plain.kv.block_manager.hash_to_block.keys() & spec.kv.block_manager.hash_to_block
    assert len(both) >= 4
    for h in both:
        a = plain.kv.tensor[:, :, plain.kv.block_manager.hash_to_block[h]]
        b = spec.kv.tensor[:, :, spec.kv.block_manager.hash_to_block[h]]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_sampled_seeded_stops_logprobs_identical(make_engine: Callable[..., LLMEngine]) -> None:
    """Seeded sampling draws the same tokens; penalties, min_tokens, logprobs, stop ids,
    stop strings and max_tokens act on each emitted token as without speculation."""
    p0, p1, p2 = PROMPTS
    reqs = {
        "seeded": (p0, SamplingParams(max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)),
        "penalised": (
            p1,
            SamplingParams(
                max_tokens=24,
                temperature=0.7,
                seed=3,
                min_tokens=10,
                repetition_penalty=1.4,
                frequency_penalty=0.5,
            ),
        ),
        "logprobs": (p2, greedy(18, logprobs=3)),
        "short": (p0, greedy(3)),
    }
    plain = make_engine()
    first = run_requests(plain, reqs)
    # Stops found in the plain run: a token id, and a string, each mid-way.
    toks = first["seeded"].token_ids
    reqs["stop_id"] = (
        p0,
        SamplingParams(
            max_tokens=24, temperature=0.9, seed=7, ignore_eos=True, stop_token_ids=[toks[9]]
        ),
    )
    text = first["logprobs"].text
    reqs["stop_str"] = (p2, greedy(18, stop=[text[len(text) // 2 : len(text) // 2 + 3]]))
    _, spec, ref, got = _both(make_engine, reqs)
    assert outputs(got) == outputs(ref)
    assert got["stop_id"].finish_reason == "stop" and len(got["stop_id"].token_ids) <= 10
    assert got["stop_str"].finish_reason == "stop"
    assert len(got["short"].token_ids) == 3
    lp, lp_ref = got["logprobs"].logprobs, ref["logprobs"].logprobs
    assert len(lp) == len(lp_ref) == 18
    for (v, top), (v_ref, top_ref) in zip(lp, lp_ref, strict=True):
        assert v == pytest.approx(v_ref, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in top_ref]
    assert spec.spec.stats.accepted_tokens > 0


def test_structured_output_drafts_checked_by_grammar(
    make_engine: Callable[..., LLMEngine],
) -> None:
    regex = {"type": "regex", "regex": r"[a-z]{2,6}( [a-z]{2,6}){3,6}\."}
    reqs = {
        f"re{i}": (p, SamplingParams(max_tokens=40, temperature=0.8, seed=i, structured=regex))
        for i, p in enumerate(PROMPTS)
    }
    reqs["free"] = (PROMPTS[0], greedy())
    _, spec, ref, got = _both(make_engine, reqs)
    assert outputs(got) == outputs(ref)
    assert all(got[f"re{i}"].finish_reason == "stop" for i in range(3))
    assert spec.spec.stats.accepted_tokens > 0


def test_config_refuses_bad_values(tiny_model_dir: Any) -> None:
    from engine_helpers import tiny_config

    for bad, words in [
        ("draft:k=2", "needs model"),
        ("draft:model=/x,k=2,min_n=1", "unknown key"),
        ("draft:model=/x,k=17", "k must"),
        ("ngram:k=0", "k must"),
        ("ngram:k=x", "integer"),
        ("medusa", "unknown method"),
        ("ngram:k=2,n=3", "unknown key"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            tiny_config(tiny_model_dir, speculative=bad)
        assert "speculative" in str(err.value)
