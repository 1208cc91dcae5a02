"""One codec for every message that crosses a process boundary.

Messages are frozen dataclasses registered under a type name with
:func:`message`. ``encode`` writes JSON with a ``"type"`` field; ``decode``
dispatches on it and raises :class:`CodecError` for an unknown type or a body
that does not fit the dataclass. Bytes fields are not supported: payloads that
are bytes (NIXL agent metadata) are carried base64-encoded as ``str``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

T = TypeVar("T")

_REGISTRY: dict[str, type] = {}


class CodecError(ValueError):
    """A message could not be decoded: unknown type, bad JSON or bad fields."""


def message(name: str):  # type: ignore[no-untyped-def]
    """Class decorator: register a dataclass under ``name`` for the codec."""

    def wrap(cls: type[T]) -> type[T]:
        assert dataclasses.is_dataclass(cls), f"{cls} must be a dataclass"
        assert name not in _REGISTRY or _REGISTRY[name] is cls, f"duplicate message {name}"
        _REGISTRY[name] = cls
        cls._message_type = name  # type: ignore[attr-defined]
        return cls

    return wrap


def to_dict(msg: Any) -> dict[str, Any]:
    name = getattr(type(msg), "_message_type", None)
    assert name is not None, f"{type(msg).__name__} is not a registered message"
    body = dataclasses.asdict(msg)
    body["type"] = name
    return body


def from_dict(body: dict[str, Any], expected: type[T] | None = None) -> T:
    if not isinstance(body, dict) or "type" not in body:
        raise CodecError("message has no 'type' field")
    name = body["type"]
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"unknown message type {name!r}; known: {sorted(_REGISTRY)}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected a {expected.__name__}, got {name!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in body.items() if k != "type"}
    unknown = set(kwargs) - set(fields)
    if unknown:
        raise CodecError(f"{name}: unknown fields {sorted(unknown)}")
    try:
        msg = cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise CodecError(f"{name}: {exc}") from exc
    validate = getattr(msg, "validate", None)
    if validate is not None:
        try:
            validate()
        except (TypeError, ValueError) as exc:
            raise CodecError(f"{name}: {exc}") from exc
    return msg  # type: ignore[no-any-return]


def encode(msg: Any) -> bytes:
    return json.dumps(to_dict(msg), separators=(",", ":")).encode()


def decode(data: bytes | str, expected: type[T] | None = None) -> T:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"not a JSON message: {exc}") from exc
    return from_dict(body, expected)
