"""Helpers of the tests that hold a fast message reader to the general codec
(test_token_lines.py, test_prefill_reply.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.protocol.codec import CodecError, encode


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
