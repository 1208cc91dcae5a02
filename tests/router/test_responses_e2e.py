"""``client.responses.create`` (the official ``openai`` client) against ``pdserve up``
(1 prefill + 1 decode worker): text, streamed events, function calls (a grammar makes the
tiny random model's call valid), ``text.format`` json_schema, a tool-result round trip,
and the stateless refusals. Greedy replies are compared with /v1/chat/completions on the
same messages: the Responses body must mean exactly that chat request."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from pdserve.testing.loopback import all_kv_free
from tests.router.pdserve_up import Up

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_text_equals_chat_completion(client: openai.OpenAI) -> None:
    model = _model(client)
    resp = client.responses.create(
        model=model,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=6,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=model,
        max_tokens=6,
        temperature=0,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ],
    )
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage is not None and resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    finish = chat.choices[0].finish_reason
    assert resp.status == ("incomplete" if finish == "length" else "completed")


def test_stream_events(client: openai.OpenAI, up: Up) -> None:
    model = _model(client)
    kw: dict[str, Any] = dict(
        model=model, input="Count to three.", max_output_tokens=8, temperature=0
    )
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    all_kv_free(up.workers)


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_required(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(
        model=_model(client),
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    if not stream:
        calls = [o for o in client.responses.create(**kw).output if o.type == "function_call"]
    else:
        events = list(client.responses.create(**kw, stream=True))
        args = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == args
        assert events[-1].type == "response.completed"
        calls = [o for o in events[-1].response.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)  # the grammar held


def test_named_tool_then_its_result(client: openai.OpenAI) -> None:
    model = _model(client)
    first = client.responses.create(
        model=model,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
        temperature=0,
    )
    call = next(o for o in first.output if o.type == "function_call")
    assert "city" in json.loads(call.arguments)
    second = client.responses.create(
        model=model,
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
    )
    assert second.status in ("completed", "incomplete") and second.output


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=_model(client),
        input="A number.",
        max_output_tokens=32,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
    )
    assert resp.status == "completed"
    assert 0 <= json.loads(resp.output_text)["n"] <= 9


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_stateless_refusals(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=_model(client), input="hi", **extra)
    body: Any = err.value.body
    assert (body.get("param") if "param" in body else body["error"]["param"]) == param
