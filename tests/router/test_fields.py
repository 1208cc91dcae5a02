"""Every request field is honoured or refused, and docs/router.md lists each one."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pdserve.router.api.fields import CHAT, COMPLETIONS, NO_EFFECT, ONLY, check_fields
from pdserve.router.errors import APIError
from pdserve.testing.loopback import ROOT

pytestmark = pytest.mark.unit


def _documented() -> set[str]:
    text = (ROOT / "docs" / "router.md").read_text()
    table = text.split("### Request fields", 1)[1].split("\n\n**", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    return {name.split(".")[0] for row in rows for name in re.findall(r"`([^`]+)`", row)}


def test_docs_table_lists_every_field() -> None:
    missing = (CHAT | COMPLETIONS | NO_EFFECT | set(ONLY)) - _documented()
    assert not missing, f"docs/router.md's field table misses {sorted(missing)}"


@pytest.mark.parametrize(
    ("field", "value", "chat"),
    [
        ("functions", [], True),
        ("audio", {}, True),
        ("tools", [], False),
        ("store", True, True),
        ("modalities", ["audio"], True),
        ("top_logprobs", 1, False),
        ("whatever", 1, False),
    ],
)
def test_unknown_or_unsupported_fields_are_refused(field: str, value: object, chat: bool) -> None:
    with pytest.raises(APIError) as err:
        check_fields({field: value}, chat)
    assert err.value.body()["error"]["param"] == field


def test_no_effect_fields_pass() -> None:
    check_fields({"metadata": {"a": "b"}, "store": False, "modalities": ["text"]}, True)


@pytest.mark.parametrize("prompt", [[1, -1], [1, True], [1, 2.0], [1, None], [3, [4]]])
def test_prompt_token_ids_must_be_non_negative_integers(prompt: list[object]) -> None:
    from pdserve.router.api.openai_request import parse_request

    with pytest.raises(APIError) as err:
        parse_request({"model": "tiny", "prompt": prompt}, False, 16)
    assert err.value.status == 400 and "prompt" in err.value.message
    assert parse_request({"model": "tiny", "prompt": [0, 7]}, False, 16).prompt_token_ids == (0, 7)


def test_prompt_token_ids_past_the_vocabulary_are_refused_naming_the_first() -> None:
    """The router's own check of token-id prompts (serving.prompt_ids): the first id at or
    past the vocabulary is named in a 400 on ``prompt``; ids below it pass as sent."""
    import types

    from pdserve.router.api.openai_request import parse_request
    from pdserve.router.api.serving import prompt_ids

    rt: Any = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=100))
    ok = parse_request({"model": "tiny", "prompt": [0, 99, 5]}, False, 16)
    assert prompt_ids(rt, ok) == [0, 99, 5]
    bad = parse_request({"model": "tiny", "prompt": [3, 150, 100, 7]}, False, 16)
    with pytest.raises(APIError) as err:
        prompt_ids(rt, bad)
    assert err.value.status == 400 and err.value.param == "prompt"
    assert "token id 150 is outside the vocabulary" in err.value.message
