"""Structured outputs in the engine: constrained and free requests in one batch."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from engine_helpers import assert_all_free, run_requests, tiny_config

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

PROMPT = [0, *range(400, 420)]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_model_dir, 256))


def sp(spec: dict[str, Any] | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 1.0, "structured": spec, **kw})


def test_json_schema_batched_with_free_requests(engine: LLMEngine) -> None:
    spec = {"type": "json_schema", "schema": SCHEMA, "param": "response_format"}
    free = {f"f{i}": (PROMPT, sp(seed=i, ignore_eos=True, max_tokens=30)) for i in range(3)}
    alone = run_requests(engine, free)
    reqs = {f"j{i}": (PROMPT, sp(spec, seed=i)) for i in range(12)}
    res = run_requests(engine, {**reqs, **free})
    for rid in reqs:
        assert res[rid].finish_reason == "stop", res[rid].text
        jsonschema.validate(json.loads(res[rid].text), SCHEMA)
    for rid in free:  # sharing a batch with masked rows changes nothing for free rows
        assert res[rid].token_ids == alone[rid].token_ids
    assert len({res[r].text for r in reqs}) > 6  # really sampled
    assert_all_free(engine)


def test_regex_choice_and_json_object(engine: LLMEngine) -> None:
    res = run_requests(
        engine,
        {
            "re": (PROMPT, sp({"type": "regex", "regex": r"[a-z]{3}-[0-9]{2}"}, seed=1)),
            "ch": (PROMPT, sp({"type": "choice", "choice": ["yes", "no", "¿quizás?"]}, seed=2)),
            "obj": (PROMPT, sp({"type": "json_object"}, seed=3, max_tokens=400)),
            "greedy": (PROMPT, sp({"type": "choice", "choice": ["left", "right"]}, temperature=0)),
        },
    )
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", res["re"].text), res["re"].text
    assert res["ch"].text in ("yes", "no", "¿quizás?")
    assert res["greedy"].text in ("left", "right")
    if res["obj"].finish_reason == "stop":  # an open object may run to max_tokens
        assert isinstance(json.loads(res["obj"].text), dict)
    assert_all_free(engine)


def test_compiled_once_per_schema(engine: LLMEngine) -> None:
    spec = {
        "type": "json_schema",
        "schema": {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]},
    }
    before = engine.grammars.num_compiled
    run_requests(engine, {f"c{i}": (PROMPT, sp(spec, seed=i)) for i in range(3)})
    run_requests(engine, {"again": (PROMPT, sp({**spec, "param": "guided_json"}, seed=9))})
    assert engine.grammars.num_compiled == before + 1
    assert_all_free(engine)


@pytest.mark.parametrize(
    "spec",
    [
        {
            "type": "json_schema",
            "schema": {"$ref": "#/definitions/nope"},
            "param": "response_format",
        },
        {"type": "regex", "regex": "(unclosed", "param": "response_format"},
        {"type": "grammar", "grammar": "root ::= undefined_rule", "param": "response_format"},
        {"type": "bogus", "param": "response_format"},
    ],
)
def test_unsupported_specs_are_refused(engine: LLMEngine, spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidParameter) as err:
        engine.add_request("bad", PROMPT, sp(spec))
    assert err.value.field == "response_format"
    assert not engine.requests


def test_refuses_ignore_eos_and_min_tokens() -> None:
    spec = {"type": "json_object", "param": "guided_json"}
    for kw in ({"ignore_eos": True}, {"min_tokens": 3}):
        with pytest.raises(InvalidParameter) as err:
            sp(spec, **kw).validate()
        assert err.value.field == "guided_json"
