"""Structured outputs through ``pdserve up`` (1P+1D) with the official client.

The random tiny model's free output is gibberish, so 100% of the constrained outputs
parsing and validating shows the decoding really is constrained, on both sides of the
P/D hand-off (the prefill worker samples the first token under the grammar; the decode
worker rebuilds the grammar state from it).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pdserve.testing.loopback import all_kv_free
from tests.router.pdserve_up import Up

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "Describe the weather in a small town in the mountains, as JSON, please."
NAME = {"type": "string", "maxLength": 10}
SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    {  # arrays
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 5,
            },
            "labels": {"type": "array", "items": NAME, "maxItems": 3},
        },
        "required": ["scores", "labels"],
    },
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
    },
    {  # numbers with bounds
        "type": "object",
        "properties": {
            "temp": {"type": "number", "minimum": -40, "maximum": 50},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "wind": {"type": "number", "exclusiveMinimum": 0, "maximum": 200},
        },
        "required": ["temp", "humidity", "wind"],
    },
    {  # all of it, in an array of objects
        "type": "array",
        "minItems": 1,
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 999},
                "kind": {"enum": ["a", "b"]},
                "tags": {"type": "array", "items": NAME, "maxItems": 2},
            },
            "required": ["id", "kind", "tags"],
        },
    },
]


def _schema_format(i: int, strict: bool) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": strict},
    }


def test_50_json_schema_requests_all_valid(client: openai.OpenAI, up: Up) -> None:
    def one(n: int) -> tuple[int, str, str | None]:
        i = n % len(SCHEMAS)
        out = client.chat.completions.create(
            model="tiny-seed0",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=300,
            temperature=1.0,
            seed=n,
            response_format=_schema_format(i, n % 2 == 0),
        )
        return i, str(out.choices[0].message.content), out.choices[0].finish_reason

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(one, range(50)))
    for i, text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert len({text for _, text, _ in results}) > 40  # sampled, not one fixed answer
    all_kv_free(up.workers)


def test_streamed_json_schema(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-seed0",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=300,
        temperature=1.0,
        seed=3,
        response_format=_schema_format(2, True),
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[2])


def test_vllm_extras_and_json_object(client: openai.OpenAI) -> None:
    def complete(**extra: Any) -> str:
        out = client.completions.create(
            model="tiny-seed0",
            prompt=PROMPT,
            max_tokens=60,
            temperature=1.0,
            seed=1,
            extra_body=extra,
        )
        return str(out.choices[0].text)

    assert re.fullmatch(r"\d{3}-[A-Z]{2}", complete(guided_regex=r"\d{3}-[A-Z]{2}"))
    assert complete(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert complete(structured_outputs={"choice": ["x1", "y2"]}) in ("x1", "y2")
    assert complete(structured_outputs={"regex": "(ab)+c"}).endswith("c")
    jsonschema.validate(json.loads(complete(guided_json=SCHEMAS[2])), SCHEMAS[2])
    out = client.chat.completions.create(
        model="tiny-seed0",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=120,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    if out.choices[0].finish_reason == "stop":  # an open object may run out of tokens
        assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    else:
        assert (out.choices[0].message.content or "").startswith("{")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "some_unknown_kind"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
        # a schema given as a string is read as a body is: no NaN, bounded depth
        ({"guided_json": '{"type": "number", "maximum": NaN}'}, "guided_json"),
        ({"guided_json": '{"a":' * 40 + "1" + "}" * 40}, "guided_json"),
    ],
)
def test_bad_structured_requests_are_refused(up: Up, extra: dict[str, Any], param: str) -> None:
    body = {
        "model": "tiny-seed0",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        **extra,
    }
    r = httpx.post(up.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_body_with_a_non_json_number_is_refused(up: Up) -> None:
    """NaN and Infinity are not JSON: json.loads took them, and a schema bound of NaN went
    on to the workers. Refused at the edge, whatever field holds them."""
    schema = b'{"type": "object", "properties": {"n": {"type": "number", "maximum": Infinity}}}'
    raw = (
        b'{"model": "tiny-seed0", "messages": [{"role": "user", "content": "hi"}], '
        b'"max_tokens": 8, "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "x", "schema": ' + schema + b"}}}"
    )
    r = httpx.post(
        up.url + "/v1/chat/completions",
        content=raw,
        timeout=60,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert "Infinity is not a JSON number" in r.json()["error"]["message"], r.text
