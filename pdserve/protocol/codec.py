"""One codec for every message that crosses a process boundary.

Messages are frozen dataclasses registered under a type name with
:func:`message`. ``encode`` writes JSON with a ``"type"`` field; ``decode``
dispatches on it and raises :class:`CodecError` for an unknown type or a body
that does not fit the dataclass: unknown or missing fields, and fields whose
JSON type does not match the annotation (``int``, ``float``, ``str``, ``bool``,
``list[...]``, ``dict[...]``, ``X | None``). A field annotated with another
dataclass is nested: a registered message by its codec form, any other dataclass
by its own ``wire`` (or ``to_dict``) / ``from_dict`` (so the sampling parameters ride
inside a worker message without the codec knowing their fields). Bytes fields are not
supported: payloads that are bytes (NIXL agent metadata) are carried base64-encoded.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from pdserve.protocol.fast_dumps import Check, dumps, finite_check

T = TypeVar("T")

_REGISTRY: dict[str, type] = {}
_HINTS: dict[type, dict[str, Any]] = {}
_SHAPES: dict[Any, tuple[Any, tuple[Any, ...]]] = {}  # hint -> (origin, args)


class CodecError(ValueError):
    """A message could not be decoded: unknown type, bad JSON or bad fields.

    ``field`` names the offending field when there is one (OpenAI's ``param``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


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
    body = {}
    # Each field's conversion is chosen once per class (``_encoders``): a scalar, a list of
    # scalars or a plain dict goes as it is; only nested dataclasses and lists that may
    # hold one are walked. (A call per field cost the router ~50 us per request.)
    for n, conv in _encoders(type(msg)):
        value = getattr(msg, n)
        body[n] = value if conv is None or value is None else conv(value)
    body["type"] = name
    return body


def _plain(value: Any) -> Any:
    if value is None or type(value) in _SCALARS:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(type(value), "_message_type"):
            return to_dict(value)
        own = getattr(value, "to_dict", None)
        return own() if own is not None else dataclasses.asdict(value)
    if isinstance(value, list):  # scalars inline: a prompt's ids were a call each
        return [v if type(v) in _SCALARS else _plain(v) for v in value]
    return value


_ENCODERS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _encoders(cls: type) -> tuple[tuple[str, Any], ...]:
    """(field, conversion or None) in field order; None: the value is JSON as it is."""
    enc = _ENCODERS.get(cls)
    if enc is None:
        enc = _ENCODERS[cls] = tuple((n, _encoder(h)) for n, h in _hints(cls).items())
    return enc


def _encoder(hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _encoder(inner[0]) if len(inner) == 1 else _plain
    if hint in _SCALARS:
        return None
    if getattr(hint, "wire", None) is not None:  # a dataclass that keeps its own codec form
        return _wire
    if origin is list and args and args[0] in _SCALARS:
        return None  # json writes the list; _plain only copied it
    if origin is dict and args and args[1] in _SCALARS:
        return None
    return _plain


_SCALARS = frozenset({int, float, str, bool})


def _wire(value: Any) -> Any:
    return value.wire  # pdserve/protocol/once.py: worked out at the first read, then kept


def all_ints(values: list[Any]) -> bool:
    """Every item is a plain ``int`` (bools are not), in one pass in C: a generator step per
    item cost ~20 us on a 64-id prompt. False for an empty list."""
    return set(map(type, values)) == {int}


def from_dict(body: dict[str, Any], expected: type[T] | None = None) -> T:
    if not isinstance(body, dict) or "type" not in body:
        raise CodecError("message has no 'type' field")
    name = body["type"]
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CodecError(f"unknown message type {name!r}; known: {sorted(_REGISTRY)}")
    if expected is not None and cls is not expected:
        raise CodecError(f"expected a {expected.__name__}, got {name!r}")
    hints, as_is = _decoders(cls)
    if not body.keys() <= as_is.keys():
        unknown = sorted(set(body) - set(hints) - {"type"})
        raise CodecError(f"{name}: unknown fields {unknown}", unknown[0])
    kwargs = {}
    for key, value in body.items():  # a value of a type taken as it is costs no call
        if type(value) in as_is[key]:
            kwargs[key] = value
        elif key != "type":
            kwargs[key] = _field(name, key, value, hints[key])
    try:
        msg = cls(**kwargs)
    except TypeError as exc:  # missing required fields
        raise CodecError(f"{name}: {exc}") from exc
    validate = getattr(msg, "validate", None)
    if validate is not None:
        try:
            validate()
        except (TypeError, ValueError) as exc:
            raise CodecError(f"{name}: {exc}", getattr(exc, "field", None)) from exc
    return msg  # type: ignore[no-any-return]


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


_DECODERS: dict[type, tuple[dict[str, Any], dict[str, frozenset[type]]]] = {}


def _decoders(cls: type) -> tuple[dict[str, Any], dict[str, frozenset[type]]]:
    """(hints, field -> the value types ``_convert`` returns unchanged; "type" included
    with none), worked out once per class."""
    dec = _DECODERS.get(cls)
    if dec is None:
        hints = _hints(cls)
        as_is = {n: _as_is(h) for n, h in hints.items()}
        dec = _DECODERS[cls] = (hints, {**as_is, "type": frozenset()})
    return dec


def _as_is(hint: Any) -> frozenset[type]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _as_is(inner[0]) | {type(None)} if len(inner) == 1 else frozenset()
    if hint in _SCALARS:
        return frozenset({hint})
    if origin is dict or hint is dict:
        return frozenset({dict})
    return frozenset()  # lists (their items are checked) and nested dataclasses


def _field(name: str, key: str, value: Any, hint: Any) -> Any:
    try:
        return _convert(value, hint)
    except CodecError as exc:
        raise CodecError(f"{name}.{key}: {exc}", exc.field or key) from exc
    except (TypeError, ValueError) as exc:  # a nested from_dict refused the value
        raise CodecError(f"{name}.{key}: {exc}", getattr(exc, "field", None) or key) from exc


def _convert(value: Any, hint: Any) -> Any:
    """``value`` checked against ``hint``; nested dataclasses built from their dicts."""
    if type(value) is hint and hint in _SCALARS:  # most fields: a str, int... as declared
        return value
    shape = _SHAPES.get(hint)
    if shape is None:
        shape = _SHAPES[hint] = (typing.get_origin(hint), typing.get_args(hint))
    origin, args = shape
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0]) if len(inner) == 1 else value
    if origin is list:
        _need(isinstance(value, list), "a list", value)
        if args and args[0] is int and (not value or all_ints(value)):
            return list(value)  # block ids and hashes: no call per element when all fit
        return [_convert(v, args[0]) for v in value] if args else value
    if origin is dict or hint is dict:
        _need(isinstance(value, dict), "an object", value)
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        _need(isinstance(value, dict), "an object", value)
        if hasattr(hint, "_message_type"):
            return from_dict({"type": hint._message_type, **value}, hint)
        own = getattr(hint, "from_dict", None)
        return own(value) if own is not None else hint(**value)
    if hint is bool:
        _need(isinstance(value, bool), "a boolean", value)
    elif hint is int:
        _need(isinstance(value, int) and not isinstance(value, bool), "an integer", value)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _need(ok, "a number", value)
        return float(value)
    elif hint is str:
        _need(isinstance(value, str), "a string", value)
    return value


def _need(ok: bool, what: str, value: Any) -> None:
    if not ok:
        raise CodecError(f"must be {what}, got {type(value).__name__}")


def encode(msg: Any) -> bytes:
    """The message as JSON: orjson's bytes where they read back as json's would
    (fast_dumps: no NaN or infinity in the message), json's otherwise."""
    check = _FINITE.get(type(msg), _UNKNOWN)
    if check is _UNKNOWN:
        check = _FINITE[type(msg)] = finite_check(type(msg), _hints)
    return dumps(to_dict(msg), check is None or check(msg))


_FINITE: dict[type, Check | None] = {}
_UNKNOWN: Any = object()


def decode(data: bytes | str, expected: type[T] | None = None) -> T:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CodecError(f"not a JSON message: {exc}") from exc
    return from_dict(body, expected)
