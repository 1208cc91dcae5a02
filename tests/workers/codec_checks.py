"""Helpers of the tests that hold a fast message reader to the general codec
(test_token_lines.py, test_prefill_reply.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from pdserve.protocol.codec import CodecError, encode, to_dict


def outcome(read: Callable[[bytes], Any], raw: bytes) -> Any:
    """What ``read`` makes of ``raw``: the message's encoding, or its CodecError's text and
    field."""
    try:
        return encode(read(raw))
    except CodecError as exc:
        return (str(exc), exc.field)


def break_field(fields: dict[str, Any], key: str, value: Any, drop: bool) -> None:
    """Remove ``key`` from ``fields`` (``drop``), or set it to ``value``."""
    if drop:
        fields.pop(key, None)
    else:
        fields[key] = value


def junk(ints: Any, floats: Any, texts: Any) -> Any:
    """Any JSON value, nested a little: what a broken field is set to."""
    return st.recursive(
        st.one_of(st.none(), st.booleans(), ints, floats, texts),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
        max_leaves=6,
    )


def broken_bodies(messages: Any, fields: Sequence[str], values: Any, inside: str = "") -> Any:
    """The JSON of a drawn message with one of ``fields`` (of its ``inside`` field's dict,
    where named) dropped or set to a drawn value."""

    @st.composite
    def draw_body(draw: Any) -> bytes:
        body = to_dict(draw(messages))
        key, value, drop = draw(st.sampled_from(fields)), draw(values), draw(st.booleans())
        break_field(body[inside] if inside else body, key, value, drop)
        return json.dumps(body).encode()

    return draw_body()
