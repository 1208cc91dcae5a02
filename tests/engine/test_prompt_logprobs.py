"""Prompt log-probabilities (echo / prompt_logprobs) equal transformers' own, in float32.

Each prompt token's logprob under the model, computed by a full forward of transformers,
is the reference. The engine must match it within 1e-4 for a whole prefill, a prefill in
chunks (a tiny token budget: rows of one prompt land in several steps), a prompt whose
prefix is in the prefix cache (the cache must be bypassed, or the cached rows would have
no logits), and a request preempted and recomputed mid-prompt. Each of these breaks if
the rows are misaligned, skipped or recorded twice.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, tiny_config

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]
TOL = 1e-4


def _reference(hf_model: Any, prompt: list[int], k: int) -> list[Any]:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    out: list[Any] = [None]
    for p in range(len(prompt) - 1):
        row = lp[p]
        chosen = float(row[prompt[p + 1]])
        # the ranks a logprob within TOL of this one may have: tokens whose logprobs are
        # that close order differently between two correct float32 forwards (one rank apart
        # on an AMD EPYC host: -10.165918 here, -10.165929 in transformers)
        ranks = range(int((row > chosen + TOL).sum()) + 1, int((row > chosen - TOL).sum()) + 2)
        vals, ids = row.topk(k)
        out.append((chosen, ranks, ids.tolist(), vals.tolist()))
    return out


def _collect(engine: LLMEngine, prompts: dict[str, list[int]], k: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    got: dict[str, Any] = {}
    while engine.has_work:
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in got, "prompt logprobs sent twice"
                got[out.request_id] = out.prompt_logprobs
    return got


def _check(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        logprob, rank, top = g
        assert abs(logprob - w[0]) < TOL and rank in w[1], (logprob, rank, w[:2])
        assert [i for i, _ in top] == w[2]
        assert all(abs(a - b) < TOL for (_, a), b in zip(top, w[3], strict=True))


def _prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 17, 40, 100]
    return {f"r{n}": [rng.randrange(3, 3000) for _ in range(n)] for n in lengths}


@pytest.mark.parametrize("budget", [2048, 7])
def test_prompt_logprobs_match_transformers(tiny_model_dir: Path, hf_model: Any, budget: int):
    engine = LLMEngine(tiny_config(tiny_model_dir, max_num_batched_tokens=budget))
    prompts = _prompts(0)
    got = _collect(engine, prompts, k=3)
    assert set(got) == set(prompts)
    for rid, prompt in prompts.items():
        _check(got[rid], _reference(hf_model, prompt, 3))
    assert_all_free(engine)


def test_cached_prefix_is_recomputed(tiny_model_dir: Path, hf_model: Any) -> None:
    """A prompt whose first blocks sit in the prefix cache still gets every row scored."""
    engine = LLMEngine(tiny_config(tiny_model_dir, enable_prefix_caching=True))
    rng = random.Random(1)
    prefix = [rng.randrange(3, 3000) for _ in range(48)]
    engine.generate([[*prefix, 5, 6]], SamplingParams(max_tokens=1, temperature=0.0))
    prompt = [*prefix, 7, 8, 9]
    got = _collect(engine, {"cached": prompt}, k=1)
    _check(got["cached"], _reference(hf_model, prompt, 1))
    # Without prompt logprobs the same prompt does hit the cache (the bypass is per request).
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_work:
        outs = engine.step()
    assert outs[0].num_cached_tokens >= 32
    assert_all_free(engine)


def test_preempted_request_scores_each_row_once(tiny_model_dir: Path, hf_model: Any) -> None:
    """Preempted after its first prompt chunk (as the scheduler does when blocks run out:
    blocks freed, recomputed from token 0), the rows already scored are not scored again."""
    engine = LLMEngine(tiny_config(tiny_model_dir, max_num_batched_tokens=16))
    prompt = _prompts(2)["r100"]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    engine.add_request("p", prompt, params)
    assert engine.step() == []  # rows 0..15 scored
    req = engine.requests["p"]
    assert len(req.prompt_logprobs) == 17
    engine.scheduler.running.remove(req)
    engine.scheduler._preempt(req)
    engine.scheduler.waiting.appendleft(req)
    got: list[Any] = []
    while engine.has_work:
        got += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs is not None]
    assert len(got) == 1
    _check(got[0], _reference(hf_model, prompt, 2))
    assert_all_free(engine)


def test_bad_prompt_logprobs_refused() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()
