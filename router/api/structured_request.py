"""The structured-output fields of a request → one engine spec (engine/structured.py).

OpenAI's ``response_format`` (``text`` | ``json_object`` | ``json_schema``) and
vLLM's extras: ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and ``structured_outputs`` ({"json" | "regex" | "choice" |
"grammar" | "json_object"}). At most one may be set. The spec names the field it
came from, so a schema the workers cannot compile is refused naming that field.
"""

from __future__ import annotations

from typing import Any

from pdserve.jsonguard import BadJSON, loads_checked
from pdserve.router.errors import invalid

GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
PAYLOAD = {"json_schema": "schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
REFUSED = ("guided_whitespace_pattern",)


# Every field read here: a body with none of them (most) has no spec, at one set operation.
FIELDS = frozenset(
    {"response_format", *GUIDED, "structured_outputs", "guided_decoding_backend", *REFUSED}
)


def structured_spec(body: dict[str, Any]) -> dict[str, Any] | None:
    if body.keys().isdisjoint(FIELDS):
        return None
    for name in REFUSED:
        if body.get(name) is not None:
            raise invalid(f"{name} is not supported by this server", name)
    backend = body.get("guided_decoding_backend")
    if backend not in (None, "", "auto", "xgrammar"):
        raise invalid(
            "guided_decoding_backend: only xgrammar is available", "guided_decoding_backend"
        )
    specs = [s for s in (_response_format(body), *_guided(body), _structured(body)) if s]
    if len(specs) > 1:
        fields = ", ".join(s["param"] for s in specs)
        raise invalid(f"set only one structured-output field, got {fields}", specs[1]["param"])
    return specs[0] if specs else None


def _object(body: dict[str, Any], param: str) -> dict[str, Any] | None:
    """The object field ``param`` of ``body``, None when unset; anything else is a 400."""
    value = body.get(param)
    if value is not None and not isinstance(value, dict):
        raise invalid(f"{param} must be an object", param)
    return value


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    param = "response_format"
    rf = _object(body, param)
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object", "param": param}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise invalid("response_format.json_schema.schema must be an object", param)
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("response_format.json_schema.strict must be a boolean", param)
        return {"type": "json_schema", "schema": js["schema"], "param": param}
    raise invalid(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}", param
    )


def _guided(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _spec(kind, body[name], name) for name, kind in GUIDED.items() if body.get(name) is not None
    ]


def _structured(body: dict[str, Any]) -> dict[str, Any] | None:
    param = "structured_outputs"
    so = _object(body, param)
    if so is None:
        return None
    set_keys = [k for k, v in so.items() if v not in (None, False)]
    unknown = [k for k in set_keys if k not in (*STRUCTURED, "json_object")]
    if unknown or len(set_keys) != 1:
        raise invalid(
            f"structured_outputs needs exactly one of {[*STRUCTURED, 'json_object']}", param
        )
    key = set_keys[0]
    if key == "json_object":
        return {"type": "json_object", "param": param}
    return _spec(STRUCTURED[key], so[key], param)


def _spec(kind: str, value: Any, param: str) -> dict[str, Any]:
    if kind == "json_schema" and isinstance(value, str):
        try:  # as a request body is read: bounded depth, no lone surrogate, no NaN
            value = loads_checked(value.encode("utf-8", "surrogatepass"))
        except BadJSON as exc:
            raise invalid(f"{param}: {exc}".replace("request body", "schema"), param) from exc
    ok = {
        "json_schema": isinstance(value, dict),
        "regex": isinstance(value, str) and bool(value),
        "choice": isinstance(value, list)
        and bool(value)
        and all(isinstance(c, str) and c for c in value),
        "grammar": isinstance(value, str) and bool(value),
    }[kind]
    if not ok:
        raise invalid(f"{param} has the wrong type for a {kind} constraint", param)
    return {"type": kind, PAYLOAD[kind]: value, "param": param}
