"""The decode stream's NDJSON lines, the one message sent per token: exact fast forms of
:func:`~pdserve.protocol.codec.encode` / :func:`~pdserve.protocol.codec.decode` for
:class:`TokenDelta`.

The general codec walks the dataclass's fields and checks every annotation on every call
(about 20 µs a line each way here); a stream line has one fixed shape, so this module
writes it from a dict literal with one cached JSON encoder, and reads it with a handful
of type checks. The bytes written and the messages read are those of the codec (the
tests compare both on random messages); anything off the common shape (an error, a
bad line) goes through the codec itself, so its errors stay
the codec's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _string
from typing import Any, Literal, TypeVar

from pdserve.protocol.codec import decode, encode, from_dict
from pdserve.protocol.contract import TokenDelta, Usage

M = TypeVar("M")

# The codec writes a message's fields in declaration order, then "type": this module
# writes the same literal order, so a new TokenDelta field must be added here too.
FIELDS = ("token_ids", "text", "finish_reason", "usage", "error", "logprobs", "prompt_logprobs")
assert tuple(f.name for f in dataclasses.fields(TokenDelta)) == FIELDS, "update token_lines"
assert tuple(f.name for f in dataclasses.fields(Usage)) == (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
), "update token_lines"
_KEYS = frozenset((*FIELDS, "type"))
_TAIL = '"usage":null,"error":null,"logprobs":null,"prompt_logprobs":null,"type":"token_delta"}\n'
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps(..., separators) builds one
# json.loads' own parser (C), without its wrappers; typeshed does not list the attribute.
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def encode_line(
    token_ids: list[int],
    text: str,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    logprobs: list[Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> bytes:
    """``TokenDelta(token_ids, text, finish_reason, usage, None, logprobs)`` as json writes
    the codec's form, byte for byte, plus the newline (``codec.encode`` may write orjson's
    bytes instead, which read back the same: fast_dumps.py)."""
    if (
        usage is None
        and logprobs is None
        and prompt_logprobs is None
        and type(text) is str
        and (finish_reason is None or type(finish_reason) is str)
        and all(type(t) is int for t in token_ids)
    ):  # the line of nearly every token: formatted, as json writes ints, strings and null
        fin = "null" if finish_reason is None else _string(finish_reason)
        ids = ",".join(map(str, token_ids))
        return (
            f'{{"token_ids":[{ids}],"text":{_string(text)},"finish_reason":{fin},{_TAIL}'
        ).encode()
    use = None
    if usage is not None:
        use = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
            "type": "usage",
        }
    body = {
        "token_ids": token_ids,
        "text": text,
        "finish_reason": finish_reason,
        "usage": use,
        "error": None,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "type": "token_delta",
    }
    try:
        return (_ENCODER.encode(body) + "\n").encode()
    except TypeError:  # a value JSON cannot write as is (a dataclass in logprobs): the codec
        delta = TokenDelta(token_ids, text, finish_reason, usage, None, logprobs, prompt_logprobs)
        return encode(delta) + b"\n"


def decode_line(line: bytes) -> TokenDelta:
    """``codec.decode(line, TokenDelta)``: the same message, or the same CodecError."""
    return fast_decode(line, TokenDelta, _KEYS, "token_delta", _delta_of)


def fast_decode(
    raw: bytes,
    cls: type[M],
    keys: frozenset[str],
    tag: str,
    build: Callable[[dict[str, Any]], M | None],
) -> M:
    """``codec.decode(raw, cls)`` for a message of one fixed shape: a body with exactly
    ``keys`` and type ``tag`` goes to ``build`` (its message, or None: not the common
    shape); everything else, and what ``build`` declines, goes to the codec, whose answer
    or CodecError it is."""
    body = body_of(raw)
    if body is None:
        return decode(raw, cls)  # the codec's answer, or its CodecError
    if type(body) is dict and body.keys() == keys and body["type"] == tag:
        message = build(body)
        if message is not None:
            return message
    return from_dict(body, cls)


def _delta_of(body: dict[str, Any]) -> TokenDelta | None:
    ids, text, finish = body["token_ids"], body["text"], body["finish_reason"]
    lps = body["logprobs"]
    usage = usage_of(body["usage"])  # the last line's
    if (
        usage is not False
        and body["error"] is None
        and type(ids) is list
        and all(type(t) is int for t in ids)
        and type(text) is str
        and (finish is None or type(finish) is str)
        and (lps is None or type(lps) is list)
        and body["prompt_logprobs"] is None
    ):
        return TokenDelta(ids, text, finish, usage, None, lps)
    return None


_USAGE_KEYS = frozenset(("prompt_tokens", "completion_tokens", "cached_tokens", "type"))


def usage_of(body: Any) -> Usage | Literal[False] | None:
    """A message's nested ``Usage`` as the codec reads it; False: not its common shape
    (then the codec decides, and says why)."""
    if body is None:
        return None
    if type(body) is not dict or body.keys() != _USAGE_KEYS or body["type"] != "usage":
        return False
    p, c, k = body["prompt_tokens"], body["completion_tokens"], body["cached_tokens"]
    if type(p) is int and type(c) is int and type(k) is int:
        return Usage(p, c, k)
    return False


def body_of(line: bytes) -> Any:
    """What ``json.loads(line)`` returns for a line that is exactly one JSON object (as the
    worker writes them: UTF-8, no surrounding space), else None (then the codec decides)."""
    if line[:1] != b"{" or line[-1:] != b"}":
        return None
    try:
        text = line.decode()
        body, end = _SCAN(text, 0)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        return None
    return body if end == len(text) else None
