"""The inputs of bench/chaos.py: a bad-input battery and poison requests.

Each bad input is (name, path, raw body bytes): sent as is, so malformed JSON and
invalid UTF-8 reach the router unchanged. A correct service answers each with a
4xx and OpenAI's error body; a 5xx (or a dropped connection) is a failure.
Poison requests are bodies that have, at one time or another, passed the edge and
raised inside a worker's engine step, failing every stream in the batch.
"""

from __future__ import annotations

import json
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _j(body: Any) -> bytes:
    return json.dumps(body).encode()


def _completion(model: str, **kw: Any) -> bytes:
    return _j({"model": model, "prompt": "Hello there", "max_tokens": 4, **kw})


def bad_inputs(model: str, huge_prompt_chars: int) -> list[tuple[str, str, bytes]]:
    """(name, path, body) for every case of the battery."""
    c = lambda **kw: _completion(model, **kw)  # noqa: E731
    cases = [
        ("malformed_json", COMPLETIONS, b'{"model": "x", "prompt": '),
        ("not_json", COMPLETIONS, b"hello"),
        ("empty_body", COMPLETIONS, b""),
        ("json_array", COMPLETIONS, b"[]"),
        ("json_null", COMPLETIONS, b"null"),
        (
            "invalid_utf8",
            COMPLETIONS,
            b'{"model": "' + model.encode() + b'", "prompt": "\xff\xfe"}',
        ),
        ("lone_surrogate", COMPLETIONS, c(prompt="a\ud800b")),
        ("deep_json", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000),
        (
            "deep_json_in_field",
            COMPLETIONS,
            b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        ),
        ("huge_prompt", COMPLETIONS, c(prompt="word " * (huge_prompt_chars // 5))),
        ("unknown_model", COMPLETIONS, _completion("no-such-model")),
        ("missing_model", COMPLETIONS, _j({"prompt": "hi"})),
        ("missing_prompt", COMPLETIONS, _j({"model": model})),
        ("prompt_wrong_type", COMPLETIONS, c(prompt={"a": 1})),
        ("token_ids_out_of_vocab", COMPLETIONS, c(prompt=[10**9, 1])),
        ("token_ids_negative", COMPLETIONS, c(prompt=[-1, 5])),
        ("empty_prompt", COMPLETIONS, c(prompt="")),
        ("temperature_negative", COMPLETIONS, c(temperature=-1)),
        ("temperature_string", COMPLETIONS, c(temperature="hot")),
        (
            "temperature_nan",
            COMPLETIONS,
            b'{"model": "' + model.encode() + b'", "prompt": "hi", "temperature": NaN}',
        ),
        ("top_p_zero", COMPLETIONS, c(top_p=0)),
        ("top_p_big", COMPLETIONS, c(top_p=2)),
        ("top_k_string", COMPLETIONS, c(top_k="x")),
        ("top_k_huge", COMPLETIONS, c(top_k=2**63, top_p=0.5)),
        ("max_tokens_zero", COMPLETIONS, c(max_tokens=0)),
        ("max_tokens_negative", COMPLETIONS, c(max_tokens=-5)),
        ("max_tokens_huge", COMPLETIONS, c(max_tokens=10**12)),
        ("max_tokens_float", COMPLETIONS, c(max_tokens=3.5)),
        ("seed_overflow", COMPLETIONS, c(seed=2**64 + 1, temperature=1.0)),
        ("seed_underflow", COMPLETIONS, c(seed=-(2**63) - 1, temperature=1.0)),
        ("seed_string", COMPLETIONS, c(seed="abc")),
        ("n_two", COMPLETIONS, c(n=2)),
        ("stop_many", COMPLETIONS, c(stop=[f"s{i}" for i in range(1000)])),
        ("stop_long", COMPLETIONS, c(stop=["x" * 1_000_000])),
        ("stop_wrong_type", COMPLETIONS, c(stop=5)),
        ("stop_token_ids_out_of_vocab", COMPLETIONS, c(stop_token_ids=[10**9], min_tokens=2)),
        ("min_tokens_over_max", COMPLETIONS, c(min_tokens=100, max_tokens=4)),
        ("stream_string", COMPLETIONS, c(stream="yes")),
        ("chat_no_messages", CHAT, _j({"model": model, "messages": []})),
        ("chat_messages_wrong_type", CHAT, _j({"model": model, "messages": "hi"})),
        ("chat_bad_role", CHAT, _j({"model": model, "messages": [{"role": "x", "content": 1}]})),
        (
            "chat_content_number",
            CHAT,
            _j({"model": model, "messages": [{"role": "user", "content": 5}]}),
        ),
        (
            "chat_lone_surrogate",
            CHAT,
            _j({"model": model, "messages": [{"role": "user", "content": "\udfff"}]}),
        ),
    ]
    return cases


def poison_bodies(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Requests that once raised inside the decode engine's step (issue 9)."""
    base = {"model": model, "prompt": "poison", "max_tokens": 8, "stream": True}
    return [
        ("seed_2_64_plus_1", {**base, "seed": 2**64 + 1, "temperature": 1.0}),
        ("seed_below_int64", {**base, "seed": -(2**63) - 1, "temperature": 1.0}),
        ("top_k_2_63", {**base, "top_k": 2**63, "top_p": 0.5, "temperature": 1.0}),
        ("stop_token_ids_vocab", {**base, "stop_token_ids": [10**9], "min_tokens": 4}),
    ]
