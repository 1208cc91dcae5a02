"""Bounds on a request's structured-output grammar, checked at the router before any
worker compiles it (issue 24 item 3): what a tenant can make a grammar compiler chew on.

* size: the spec's JSON (schema, regex, grammar, choices; for ``tool_choice: required``
  every tool's schema) at most ``--max-schema-bytes``;
* depth: nesting of objects/arrays inside the schema at most MAX_SCHEMA_DEPTH;
* alternatives: enum values, ``anyOf``/``oneOf`` branches and choices, all together, at
  most MAX_ALTERNATIVES (a huge enum or a tool list is compiled into one alternation).

A spec past a bound is a 400 naming the field it came from and the limit. The workers
add the compile deadline (``--grammar-compile-timeout``, worker/core/loop.py) for what
stays within these bounds and is still slow (regexes with nested bounded repetition).
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.router.errors import invalid

MAX_SCHEMA_BYTES = 64 << 10
MAX_SCHEMA_DEPTH = 24  # JSON levels (a schema level is two: the schema, its properties)
MAX_ALTERNATIVES = 4096
BRANCHES = ("anyOf", "oneOf", "enum")


def check_grammar(spec: dict[str, Any] | None, max_bytes: int = MAX_SCHEMA_BYTES) -> None:
    if spec is None:
        return
    param = str(spec.get("param") or "structured")
    payload = {k: v for k, v in spec.items() if k != "param"}
    size = len(json.dumps(payload, ensure_ascii=False).encode())
    if size > max_bytes:
        raise invalid(
            f"{param}: the structured-output spec has {size} bytes, more than "
            f"--max-schema-bytes ({max_bytes})",
            param,
            "grammar_too_large",
        )
    depth, alternatives = _measure(payload.get("schema"), 0)
    alternatives += len(payload.get("choice") or ())
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid(
            f"{param}: the schema nests {depth} levels deep, more than the limit "
            f"of {MAX_SCHEMA_DEPTH}",
            param,
            "grammar_too_deep",
        )
    if alternatives > MAX_ALTERNATIVES:
        raise invalid(
            f"{param}: the spec has {alternatives} alternatives (enum values, "
            f"anyOf/oneOf branches, choices), more than the limit of "
            f"{MAX_ALTERNATIVES}",
            param,
            "grammar_too_many_alternatives",
        )


def _measure(node: Any, depth: int) -> tuple[int, int]:
    """(deepest nesting of objects/arrays, alternatives) under ``node``."""
    if isinstance(node, dict):
        deepest, alternatives = depth + 1, 0
        for key, value in node.items():
            if key in BRANCHES and isinstance(value, list):
                alternatives += len(value)
            d, a = _measure(value, depth + 1)
            deepest, alternatives = max(deepest, d), alternatives + a
        return deepest, alternatives
    if isinstance(node, list):
        deepest, alternatives = depth + 1, 0
        for value in node:
            d, a = _measure(value, depth + 1)
            deepest, alternatives = max(deepest, d), alternatives + a
        return deepest, alternatives
    return depth, 0
