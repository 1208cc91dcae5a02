"""Penalties, min-p and logit_bias through the engine, batched with free requests."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, run_requests

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.penalties import token_counts
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = [0, *range(400, 420)]


def sp(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 32, "ignore_eos": True, "temperature": 0.0, **kw})


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> LLMEngine:
    from engine_helpers import tiny_config

    return LLMEngine(tiny_config(tiny_model_dir, 128))


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_each_penalty_changes_greedy_output(engine: LLMEngine) -> None:
    # The random model repeats itself only over a long enough greedy run.
    reqs = {
        "free": (PROMPT, sp(max_tokens=150)),
        "presence": (PROMPT, sp(max_tokens=150, presence_penalty=2.0)),
        "frequency": (PROMPT, sp(max_tokens=150, frequency_penalty=2.0)),
        "repetition": (PROMPT, sp(max_tokens=150, repetition_penalty=3.0)),
    }
    res = run_requests(engine, reqs)
    base = res["free"].token_ids
    alone = run_requests(engine, {"alone": (PROMPT, sp(max_tokens=150))})["alone"].token_ids
    assert base == alone  # penalised batch-mates do not touch a free request's row
    assert _repeats(base) > 4, "the greedy baseline must repeat itself for this test to bite"
    for name in ("presence", "frequency", "repetition"):
        out = res[name].token_ids
        assert out != base, name
        assert _repeats(out) < _repeats(base), name
    # A negative presence penalty rewards repeats instead.
    neg = sp(max_tokens=150, presence_penalty=-2.0)
    more = run_requests(engine, {"neg": (PROMPT, neg)})["neg"].token_ids
    assert _repeats(more) >= _repeats(base)
    assert_all_free(engine)


def test_repetition_penalty_covers_the_prompt(engine: LLMEngine) -> None:
    # The first greedy token is in the prompt if we make it so: a prompt that ends with it.
    first = run_requests(engine, {"f": (PROMPT, sp(max_tokens=1))})["f"].token_ids[0]
    prompt = [*PROMPT, first]
    base = run_requests(engine, {"b": (prompt, sp(max_tokens=1))})["b"].token_ids[0]
    rep = sp(max_tokens=1, repetition_penalty=10.0)
    out = run_requests(engine, {"r": (prompt, rep)})["r"].token_ids[0]
    assert out not in prompt or base not in prompt
    assert_all_free(engine)


def test_logit_bias_forces_and_bans(engine: LLMEngine) -> None:
    base = run_requests(engine, {"b": (PROMPT, sp())})["b"].token_ids
    forced = 1234
    res = run_requests(
        engine,
        {
            "force": (PROMPT, sp(logit_bias={forced: 100.0})),
            "force_t1": (PROMPT, sp(temperature=1.0, seed=3, logit_bias={forced: 100.0})),
            "ban": (PROMPT, sp(logit_bias={base[0]: -100.0})),
            "free": (PROMPT, sp()),
        },
    )
    assert res["force"].token_ids == [forced] * 32
    assert res["force_t1"].token_ids == [forced] * 32
    assert res["ban"].token_ids[0] != base[0]
    assert res["free"].token_ids == base
    assert_all_free(engine)


def test_min_p_one_is_greedy(engine: LLMEngine) -> None:
    base = run_requests(engine, {"b": (PROMPT, sp())})["b"].token_ids
    res = run_requests(
        engine, {f"m{i}": (PROMPT, sp(temperature=1.5, seed=i, min_p=1.0)) for i in range(3)}
    )
    assert all(r.token_ids == base for r in res.values())
    loose = run_requests(engine, {"l": (PROMPT, sp(temperature=1.5, seed=0, min_p=0.0))})
    assert loose["l"].token_ids != base  # without min_p the same seeds really sample
    assert_all_free(engine)


def test_penalties_flip_a_near_tie_in_the_sampler() -> None:
    # Token 5 leads token 6 by 1.0; having produced 5 once, each penalty must flip it.
    logits = torch.zeros(4, 16)
    logits[:, 5], logits[:, 6] = 3.0, 2.0
    params = [sp(), sp(presence_penalty=1.5), sp(frequency_penalty=1.5), sp(repetition_penalty=2.0)]
    reqs = [Request(f"r{i}", [0], p, output_token_ids=[5]) for i, p in enumerate(params)]
    picks = Sampler(torch.device("cpu")).sample(logits, reqs, [[]] * 4)
    assert picks == [5, 6, 6, 6]


def test_token_counts_is_one_scatter() -> None:
    counts = token_counts([[1, 1, 3], [], [0]], 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "x"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_values_name_their_field(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**kw).validate()
    assert err.value.field == field


def test_logit_bias_outside_vocab_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("x", PROMPT, sp(logit_bias={10**6: 1.0}))
    assert err.value.field == "logit_bias"
    # Keys arrive as strings over JSON: from_dict turns them back into ids.
    assert SamplingParams.from_dict({"logit_bias": {"7": 2}}).logit_bias == {7: 2}
    assert not engine.requests
