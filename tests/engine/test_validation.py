"""Bad input raises InvalidParameter naming the field, and leaves nothing queued."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from engine_helpers import assert_all_free, run_requests

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = [0, 500, 501, 502]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any) -> LLMEngine:
    from engine_helpers import tiny_config

    # max_model_len 256 keeps the context checks quick; 64 blocks hold 1024 tokens.
    return LLMEngine(tiny_config(tiny_model_dir, 64, max_model_len=256))


def _rejects(engine: LLMEngine, field: str, prompt: list[int], **params: Any) -> None:
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert err.value.field == field, str(err.value)
    assert str(err.value)  # a message for the client, not just the field
    assert not engine.has_work and not engine.requests
    assert_all_free(engine)


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("max_tokens", {"max_tokens": 2.5}),
        ("max_tokens", {"max_tokens": True}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_p", {"top_p": -0.5}),
        ("top_p", {"top_p": "0.5"}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("top_k", {"top_k": -2}),
        ("seed", {"seed": 1.5}),
        ("stop", {"stop": [""]}),
        ("stop", {"stop": [3]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("ignore_eos", {"ignore_eos": 1}),
        ("min_tokens", {"min_tokens": -1}),
    ],
)
def test_bad_sampling_params(engine: LLMEngine, field: str, params: dict[str, Any]) -> None:
    _rejects(engine, field, PROMPT, **params)


def test_bad_prompts(engine: LLMEngine) -> None:
    _rejects(engine, "prompt", [])
    _rejects(engine, "prompt", [0, engine.vocab_size])
    _rejects(engine, "prompt", [0, -1])
    _rejects(engine, "prompt", [0, "7"])  # type: ignore[list-item]
    _rejects(engine, "prompt", [5] * 256)  # the whole context
    _rejects(engine, "prompt", [5] * 300)
    _rejects(engine, "max_tokens", [5] * 200, max_tokens=57)  # 200 + 57 > 256


def test_from_dict_names_unknown_and_bad_fields() -> None:
    with pytest.raises(InvalidParameter) as err:
        SamplingParams.from_dict({"max_tokens": 4, "best_of": 2})
    assert err.value.field == "best_of"
    with pytest.raises(InvalidParameter) as err:
        SamplingParams.from_dict({"top_p": 2})
    assert err.value.field == "top_p"
    params = SamplingParams.from_dict({"stop": "END", "max_tokens": 3, "seed": None})
    assert params.stop == ["END"] and params.max_tokens == 3


def test_duplicate_request_id(engine: LLMEngine) -> None:
    engine.add_request("dup", PROMPT, SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("dup", PROMPT, SamplingParams(max_tokens=3))
    assert err.value.field == "request_id"
    assert list(engine.requests) == ["dup"] and len(engine.scheduler.waiting) == 1
    while engine.has_work:
        engine.step()
    assert_all_free(engine)


def test_engine_serves_after_errors(engine: LLMEngine) -> None:
    for bad in ({"max_tokens": 0}, {"top_p": 3}):
        with pytest.raises(InvalidParameter):
            engine.add_request("x", PROMPT, SamplingParams(**bad))
    res = run_requests(engine, {"x": (PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))})
    assert res["x"].finish_reason == "length" and len(res["x"].token_ids) == 5
    assert_all_free(engine)


def test_request_larger_than_the_pool(make_engine: Callable[..., LLMEngine]) -> None:
    small = make_engine(num_blocks=4)  # 64 tokens
    _rejects(small, "max_tokens", [5] * 40, max_tokens=30)
    res = run_requests(small, {"ok": ([5] * 40, SamplingParams(max_tokens=24, ignore_eos=True))})
    assert len(res["ok"].token_ids) == 24
    assert_all_free(small)


def test_engine_config_refuses_zero_cpu_threads(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from pdserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        EngineConfig(model=str(tiny_model_dir), cpu_threads=0)
