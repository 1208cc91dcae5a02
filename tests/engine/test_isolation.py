"""Defence in depth: a request whose own work raises in the step fails alone.

The values below are refused by ``SamplingParams.validate``; these tests slip
them past it (or break a request's detokenizer) to show that the step itself
isolates the culprit: it ends with ``error`` / ``request_failed`` while the
rest of its batch finishes exactly as it would have without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from engine_helpers import assert_all_free

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.outputs import REQUEST_FAILED, RequestFailed, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = {f"ok{i}": [7 + i, 300 + i, 301, 302, 303] for i in range(4)}


def _run(
    engine: LLMEngine, poison: Callable[[LLMEngine], None], params: SamplingParams = GREEDY
) -> dict[str, RequestOutput]:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    engine.add_request("poison", [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.8))
    poison(engine)
    finals: dict[str, RequestOutput] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in [*PROMPTS, "poison"]}
    while engine.has_work:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finals[out.request_id] = replace(out, token_ids=tokens[out.request_id])
    return finals


def _expected(engine: LLMEngine, params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    return dict(zip(PROMPTS, engine.generate(list(PROMPTS.values()), params), strict=True))


def _set_params(**bad: Any) -> Callable[[LLMEngine], None]:
    def poison(engine: LLMEngine) -> None:
        req = engine.requests["poison"]
        req.params = replace(req.params, **bad)  # replace() does not validate

    return poison


def _broken_detokenizer(engine: LLMEngine) -> None:
    def boom(_: Any) -> Any:
        raise UnicodeError("detokenizer exploded")

    engine.outputs.streams["poison"].append = boom  # type: ignore[method-assign, assignment]


@pytest.mark.parametrize(
    "poison",
    [
        # (seed=2**64 + 1, the "Overflow when unpacking long long", no longer raises
        # in the step at all: each draw's seed is reduced mod 2**64, sampler.position_seed)
        _set_params(top_k=2**63, top_p=0.5),
        _set_params(stop_token_ids=[10**6], min_tokens=3),  # IndexError when banning
        _broken_detokenizer,
    ],
    ids=["top_k", "stop_token_ids", "detokenizer"],
)
def test_poison_fails_alone(
    make_engine: Callable[..., LLMEngine], poison: Callable[[LLMEngine], None]
) -> None:
    engine = make_engine()
    expected = _expected(engine)
    finals = _run(engine, poison)
    bad = finals.pop("poison")
    assert bad.finish_reason == "error" and bad.error_code == REQUEST_FAILED, bad
    assert bad.error.startswith("request failed:")
    assert {rid: (o.finish_reason, o.token_ids) for rid, o in finals.items()} == {
        rid: ("length", ids) for rid, ids in expected.items()
    }
    assert_all_free(engine)


def test_neighbours_penalties_are_applied_once_in_the_retry(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """Biases and penalties edit the logits in place: the row-by-row retry after a
    failed batch starts again from the model's logits, not from edited ones."""
    engine = make_engine()
    params = replace(
        GREEDY, presence_penalty=1.5, repetition_penalty=1.3, logit_bias={301: 5.0, 7: -3.0}
    )
    expected = _expected(engine, params)
    finals = _run(engine, _set_params(top_k=2**63, top_p=0.5), params)
    assert finals.pop("poison").error_code == REQUEST_FAILED
    assert {rid: o.token_ids for rid, o in finals.items()} == expected
    assert_all_free(engine)


def test_validation_refuses_what_would_break_the_step(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(num_blocks=16)
    for bad, field in [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": [engine.vocab_size]}, "stop_token_ids"),
        ({"stop": ["y" * 257]}, "stop"),
        ({"stop": ["\ud800"]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": float("inf")}, "temperature"),
    ]:
        with pytest.raises(InvalidParameter) as err:
            engine.add_request("x", [1, 2, 3], SamplingParams(**bad))
        assert err.value.field == field, (bad, err.value)
    for edge in (2**64 - 1, -(2**63)):  # the ends of the range work
        engine.add_request(f"s{edge}", [1, 2, 3], SamplingParams(max_tokens=2, seed=edge))
    while engine.has_work:
        engine.step()
    assert_all_free(engine)


def test_request_state_failure_is_a_request_fault(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(num_blocks=16)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("tokenizer state")

    monkeypatch.setattr("pdserve.engine.input_processor.TextStream", broken)
    with pytest.raises(RequestFailed):
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    assert not engine.requests and not engine.has_work
    assert_all_free(engine)
