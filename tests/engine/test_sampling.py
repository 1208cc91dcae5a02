"""Sampling through the engine: seeds, top-k/top-p, temperature, and how requests end."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, run_requests

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, argmax_rows
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPTS = [[0, *range(400, 400 + n)] for n in (5, 23, 60, 7)]


def sp(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **kw})


@pytest.fixture
def engine(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    return make_engine(num_blocks=128)


def test_seeded_sampling_ignores_batch_mates(engine: LLMEngine) -> None:
    # Batch-mates change the step's shapes, so the logits differ in their last bits;
    # the draws must not (the noise belongs to token ids, not to logit ranks).
    seeded = {f"s{i}": (p, sp(seed=7 + i, max_tokens=48)) for i, p in enumerate(PROMPTS)}
    alone = {rid: run_requests(engine, {rid: req})[rid].token_ids for rid, req in seeded.items()}
    mates = {f"m{i}": (p, sp(seed=None if i % 2 else 100 + i)) for i, p in enumerate(PROMPTS)}
    batch = run_requests(engine, {**seeded, **mates})
    assert {rid: batch[rid].token_ids for rid in seeded} == alone
    alone = alone["s0"][:24]
    # A seed of its own per request: a different seed, different tokens.
    other = run_requests(engine, {"o": (PROMPTS[0], sp(seed=8))})["o"].token_ids
    assert other != alone
    assert len(set(alone)) > 3  # really sampled, not stuck on one token
    assert_all_free(engine)


def test_top_k_1_and_tiny_top_p_are_greedy(engine: LLMEngine) -> None:
    reqs = {}
    for i, p in enumerate(PROMPTS):
        reqs[f"g{i}"] = (p, sp(temperature=0.0))
        reqs[f"k{i}"] = (p, sp(temperature=1.5, top_k=1, seed=i))
        reqs[f"p{i}"] = (p, sp(temperature=1.5, top_p=1e-6))
    res = run_requests(engine, reqs)
    for i in range(len(PROMPTS)):
        assert res[f"k{i}"].token_ids == res[f"g{i}"].token_ids
        assert res[f"p{i}"].token_ids == res[f"g{i}"].token_ids
    assert_all_free(engine)


def _draws(params: SamplingParams, probs: list[float], n: int) -> Counter[int]:
    """Sample ``n`` rows of the same distribution through the Sampler, one request each."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([math.log(p) for p in probs]).repeat(n, 1)
    reqs = [Request(f"r{i}", [1], params) for i in range(n)]
    return Counter(sampler.sample(logits, reqs, [[] for _ in reqs]))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
        # T=0.5 squares the probabilities: 0.25, 0.09, 0.0225, 0.0025 renormalised.
        (SamplingParams(temperature=0.5), [0.6757, 0.2432, 0.0608, 0.0068]),
        (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
        # top_p 0.7: 0.5 is not enough, 0.5 + 0.3 is; the tail is dropped.
        (SamplingParams(temperature=1.0, top_p=0.7), [0.625, 0.375, 0.0, 0.0]),
        (SamplingParams(temperature=1.0, top_p=0.5), [1.0, 0.0, 0.0, 0.0]),
        (SamplingParams(temperature=100.0), [0.25, 0.25, 0.25, 0.25]),
    ],
)
def test_sampled_distribution(params: SamplingParams, expected: list[float]) -> None:
    n = 8000
    counts = _draws(params, [0.5, 0.3, 0.15, 0.05], n)
    for token, p in enumerate(expected):
        freq = counts[token] / n
        sigma = math.sqrt(max(p * (1 - p), 1e-9) / n)
        assert abs(freq - p) < 5 * sigma + 1e-3, (token, freq, p)


def test_seeded_draws_survive_last_bit_logit_changes() -> None:
    # Near-flat logits: a 1e-6 change reorders the ranks of almost every token. A draw
    # keyed to token ids stays put; one keyed to ranks would land elsewhere.
    logits = torch.zeros(32, 1000)
    nudged = logits + 1e-6 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    picks = []
    for rows in (logits, nudged):
        reqs = [Request(f"r{i}", [1], sp(seed=i)) for i in range(len(rows))]
        picks.append(Sampler(torch.device("cpu")).sample(rows.clone(), reqs, [[]] * len(reqs)))
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 20  # and the draws do differ between seeds


def test_banned_tokens_are_never_drawn() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    reqs = [Request("g", [1], sp(temperature=0.0)), Request("s", [1], sp(temperature=1.0))]
    assert sampler.sample(logits, reqs, [[0], [0, 1]]) == [1, 2]


def _greedy_run(engine: LLMEngine, **kw: Any) -> Any:
    return run_requests(engine, {"x": (PROMPTS[1], sp(temperature=0.0, **kw))})["x"]


def test_max_tokens_ends_with_length(engine: LLMEngine) -> None:
    for n in (1, 2, 17):
        res = _greedy_run(engine, max_tokens=n)
        assert res.finish_reason == "length" and len(res.token_ids) == n
        assert res.text == engine.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    assert_all_free(engine)


def test_stop_token_ids(engine: LLMEngine) -> None:
    full = _greedy_run(engine, max_tokens=30).token_ids
    stop = full[5]
    first = full.index(stop)
    res = _greedy_run(engine, max_tokens=30, stop_token_ids=[stop])
    assert res.finish_reason == "stop"
    assert res.token_ids == full[: first + 1]  # the stop token is the last one returned
    assert_all_free(engine)


def test_stop_strings(engine: LLMEngine) -> None:
    full = _greedy_run(engine, max_tokens=40)
    text = full.text
    assert len(text) > 20
    stop = text[10:13]
    cut = text.index(stop)
    res = _greedy_run(engine, max_tokens=40, stop=[stop, "never-in-this-text-\u00e9"])
    assert res.finish_reason == "stop"
    assert res.text == text[:cut]  # the stop string itself is not returned
    assert len(res.token_ids) < len(full.token_ids)
    assert_all_free(engine)


def test_eos_ignore_eos_and_min_tokens(engine: LLMEngine) -> None:
    # The random model rarely picks the real EOS: declare a token it does pick to be EOS.
    full = _greedy_run(engine, max_tokens=30).token_ids
    eos = full[4]
    first = full.index(eos)
    engine.outputs.eos_token_ids = {eos}
    stopped = run_requests(
        engine, {"e": (PROMPTS[1], sp(temperature=0.0, ignore_eos=False, max_tokens=30))}
    )["e"]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full[: first + 1]
    assert _greedy_run(engine, max_tokens=30).token_ids == full  # ignore_eos: runs on
    held = run_requests(
        engine,
        {
            "m": (
                PROMPTS[1],
                sp(temperature=0.0, ignore_eos=False, max_tokens=30, min_tokens=first + 3),
            )
        },
    )["m"]
    assert len(held.token_ids) >= first + 3
    assert eos not in held.token_ids[: first + 3]  # banned until min_tokens are out
    assert held.token_ids[:first] == full[:first]
    assert_all_free(engine)


def test_argmax_rows_is_torch_argmax() -> None:
    """The numpy-backed row argmax picks what torch.argmax picks: the first maximum,
    ties, -inf rows, NaN (counted as the maximum) and a non-contiguous view included."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=gen)
    x[1, 7] = x[1, 200] = 50.0  # a tie: the first one
    x[2] = float("-inf")  # every id banned
    x[3, 5], x[3, 9] = float("nan"), 1e9  # NaN wins, as in torch
    x[4, :] = 0.0  # all equal
    for t in (x, x[:, ::2], x.double()):
        assert argmax_rows(t).tolist() == t.argmax(dim=-1).tolist()
    assert argmax_rows(x).dtype == torch.int64
