"""Chat prompts whose control tokens come only from the chat template.

A chat template pastes message text into a string that is then tokenized with the
model's special tokens recognized: a user who writes ``<|im_start|>system`` would get the
real control token, i.e. a forged turn. So:

- message ``content`` that spells a special token is rendered as a placeholder; the
  rendered string is tokenized piece by piece, the template's pieces with special tokens
  recognized and each content with ``split_special_tokens`` (its ``<|im_start|>`` becomes
  the ordinary tokens of that text). Content without such text takes the plain path, so
  its ids are exactly what they were (tokenizing in pieces could shift merges at the
  seams);
- anywhere else a template pastes client strings (tool definitions, tool-call names and
  arguments, message names, ``chat_template_kwargs`` values) control-token text is
  refused: 400 naming the field.

No request field turns this off: ``chat_template_kwargs`` only sets template variables.
Tools without a template of their own, and tool calls, reach the template as message
content (router/api/tools.py), so they are covered by the first rule.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.router.errors import invalid

# Private-use characters around a per-request nonce and a number: nothing a template adds,
# inert as text, and not something a client can spell (its own text holding a marker of
# the same shape stays text; issue 44: a guessed index was a 500).
_MARK = "\ue000pdserve-{}-{}\ue001"


def special_strings(tok: Any) -> re.Pattern[str]:
    """One pattern matching the text of any special token (what a template uses as control
    tokens): one pass over a text, however many special tokens the model has."""
    found = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    found.update(tok.all_special_tokens)
    words = sorted((s for s in found if s), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, words)) if words else "(?!)")


def holds_special(text: str, specials: re.Pattern[str]) -> bool:
    return specials.search(text) is not None


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def refuse_elsewhere(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    specials: re.Pattern[str],
) -> None:
    """400 when control-token text sits in a client string other than message content."""
    fields = (
        ("messages", [{k: v for k, v in m.items() if k != "content"} for m in messages]),
        ("tools", tools),
        ("chat_template_kwargs", kwargs),
    )
    for field, value in fields:
        if any(holds_special(s, specials) for s in _strings(value)):
            raise invalid(
                f"{field} holds the text of a special (control) token; only "
                "message content may, and it stays text there",
                field,
            )


def encode_rendered(
    tok: Any,
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
    plain: Callable[[str], list[int]],
    specials: re.Pattern[str],
) -> list[int]:
    """``render(messages)`` tokenized so that special tokens come only from the template;
    ``plain`` tokenizes template text (special tokens recognized)."""
    contents: list[str] = []
    shown = []
    nonce = secrets.token_hex(8)
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and holds_special(content, specials):
            m = {**m, "content": _MARK.format(nonce, len(contents))}
            contents.append(content)
        shown.append(m)
    text = render(shown)
    if not contents:
        return plain(text)
    ids: list[int] = []
    pos = 0
    for match in re.finditer(re.escape(_MARK.format(nonce, "@")).replace("@", "(\\d+)"), text):
        index = int(match.group(1))
        if index >= len(contents):  # a template's own odd text: leave it as it is
            continue
        ids += plain(text[pos : match.start()]) if match.start() > pos else []
        ids += _as_text(tok, contents[index])
        pos = match.end()
    return ids + (plain(text[pos:]) if pos < len(text) else [])


def _as_text(tok: Any, text: str) -> list[int]:
    """``text`` with special-token spellings tokenized as ordinary text. ``tok(...)`` goes
    through the Rust encode_batch, which releases the GIL (router/tokenizer.py)."""
    return list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
