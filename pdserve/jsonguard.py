"""JSON request bodies decoded safely: one function for the router and the workers.

``json.loads`` accepts what the rest of the service cannot take: nesting deep
enough to raise RecursionError, lone UTF-16 surrogates (``"\\ud800"``) that
make tokenizers and every UTF-8 writer downstream raise, and ``NaN``, ``Infinity``
and ``-Infinity``, which are not JSON (RFC 8259) and which a schema or a bias would carry
to the workers as no number at all. ``loads_checked`` refuses them with
:class:`BadJSON`, naming the top-level field at fault where it can.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.protocol.sampling_params import valid_text

MAX_JSON_DEPTH = 32  # OpenAI bodies need 5 (messages -> parts -> part); 32 is generous
# A lone surrogate can only come from a \uD800-\uDFFF escape: raw UTF-8 cannot encode one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BadJSON(ValueError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def loads_checked(raw: bytes) -> Any:
    """Decode ``raw``; raise BadJSON for invalid JSON, too deep nesting or a lone
    surrogate. CPU-bound on large bodies: the router calls it off its event loop."""
    try:
        body = _STRICT.decode(_text(raw))  # json.loads(raw, parse_constant=_not_json)
    except RecursionError:
        raise BadJSON(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _NotANumber as exc:  # read again to name the field (the error path only)
        where = _field_of(json.loads(raw, parse_constant=lambda _name: _NOT_A_NUMBER))
        raise BadJSON(f"request body is not valid JSON: {exc}", where) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadJSON(f"request body is not valid JSON: {exc}") from exc
    check_text = _SURROGATE_ESCAPE.search(raw) is not None
    # Fewer brackets than the depth limit cannot nest past it: nothing left to walk.
    if check_text or raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        check_tree(body, check_text)
    return body


def _text(raw: bytes | bytearray | str) -> str:
    """The text ``json.loads`` decodes (bytes: UTF-8, or UTF-16/32 by their first bytes),
    with its errors."""
    if isinstance(raw, str):
        if raw.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", raw, 0)
        return raw
    if not isinstance(raw, (bytes, bytearray)):
        raise TypeError(f"the JSON object must be str, bytes or bytearray, not {type(raw)}")
    return raw.decode(json.detect_encoding(raw), "surrogatepass")


class _NotANumber(ValueError):
    pass


_NOT_A_NUMBER = object()  # stands for NaN / Infinity when the field is looked for


def _not_json(name: str) -> Any:
    raise _NotANumber(f"{name} is not a JSON number")


# One decoder for every body: json.loads with a keyword builds a JSONDecoder (and its
# scanner) per call, ~0.5% of the router's CPU on the P/D path.
_STRICT = json.JSONDecoder(parse_constant=_not_json)


def _field_of(body: Any) -> str | None:
    """The top-level key whose value holds ``_NOT_A_NUMBER``."""
    if not isinstance(body, dict):
        return None
    for key, value in body.items():
        stack = [value]
        while stack:
            node = stack.pop()
            if node is _NOT_A_NUMBER:
                return str(key)
            if isinstance(node, dict):
                stack += node.values()
            elif isinstance(node, list):
                stack += node
    return None


def check_tree(body: Any, check_text: bool = True) -> None:
    """Depth at most ``MAX_JSON_DEPTH``; every string and key valid Unicode (when
    ``check_text``). The error names the top-level field the problem sits in."""
    if not isinstance(body, (dict, list)):
        return  # a bare scalar: the caller refuses it, it is never read
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        node, depth, field = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadJSON(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", field)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            where = field if field is not None or not isinstance(key, str) else key
            if check_text and isinstance(key, str) and not valid_text(key):
                raise BadJSON("a key holds invalid Unicode (a lone surrogate)", where)
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, where))
            elif check_text and isinstance(value, str) and not valid_text(value):
                raise BadJSON(
                    f"{where or 'the body'} holds invalid Unicode (a lone surrogate)", where
                )
