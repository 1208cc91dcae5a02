"""Tool calling through ``pdserve up`` (1P+1D) with the official client: required and
named ``tool_choice``, streamed and not, valid JSON for their schemas from a random model."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

CITY = {"type": "string", "maxLength": 12}
FUNCTIONS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": CITY,
            "unit": {"enum": ["C", "F"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    },
    "book_table": {
        "type": "object",
        "properties": {
            "guests": {"type": "integer", "minimum": 1, "maximum": 12},
            "names": {"type": "array", "items": CITY, "maxItems": 3},
        },
        "required": ["guests", "names"],
        "additionalProperties": False,
    },
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": p}}
    for n, p in FUNCTIONS.items()
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Oslo this week?"}]
# What the tool_choice tests ask with (each adds its choice, a token budget and a seed).
SAMPLED = {"model": "tiny-seed0", "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0}


def _check(calls: list[tuple[str, str]], parallel: bool = True) -> None:
    assert calls and (parallel or len(calls) == 1)
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), FUNCTIONS[name])


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                if tc.id is not None:  # the name comes first, with the id
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][1] += tc.function.arguments or ""
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice(client: openai.OpenAI, parallel: bool) -> None:
    for seed in range(2):
        kw: dict[str, Any] = {
            **SAMPLED,
            "tool_choice": "required",
            "parallel_tool_calls": parallel,
            "max_tokens": 400,
            "seed": seed,
        }
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c.id.startswith("call_") for c in choice.message.tool_calls or [])
        _check(calls, parallel)
        streamed, finish = _streamed(client, **kw)
        assert finish == "tool_calls"
        assert streamed == calls  # same seed: the same calls, streamed name first
        _check(streamed, parallel)


def test_named_tool_choice(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "book_table"}}
    for seed in range(2):
        kw: dict[str, Any] = {**SAMPLED, "tool_choice": named, "max_tokens": 300, "seed": seed}
        out = client.chat.completions.create(**kw)
        calls = [
            (c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls or []
        ]
        assert out.choices[0].finish_reason == "tool_calls"
        assert [n for n, _ in calls] == ["book_table"]
        _check(calls)
        streamed, finish = _streamed(client, **kw)
        assert streamed == calls and finish == "tool_calls"


def test_conversation_with_tool_results_and_auto(client: openai.OpenAI) -> None:
    args = '{"city": "Oslo", "unit": "C", "days": 2}'
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(
        model="tiny-seed0", messages=messages, tools=TOOLS, max_tokens=16, temperature=0.0
    )
    choice = out.choices[0]
    # The random model's free text is no call: auto answers it as content.
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    none = client.chat.completions.create(
        model="tiny-seed0", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "logprobs": True}, "logprobs"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "x",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"$ref": "#/nope"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-seed0", messages=MESSAGES, max_tokens=8, extra_body=extra
        )
    assert err.value.body["param"] == param  # type: ignore[index]
