"""Per-request sampling parameters, validated at the edge.

``SamplingParams.validate`` raises :class:`InvalidParameter` naming the field;
the router maps it to an OpenAI 400 with ``param`` set, the workers do the same.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from pdserve.protocol.once import once


class InvalidParameter(ValueError):
    """A request parameter is invalid. ``field`` names it (OpenAI's ``param``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


# Ranges of the values that reach torch and the engine: beyond them they overflow a C
# integer in the middle of a batch step (a seed is a uint64 or an int64 to torch).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOKENS = 2**31 - 1
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: the same as no top-k
MAX_STOP = 16
MAX_STOP_CHARS = 256  # the stop checker holds back up to this many characters per token
MAX_STOP_TOKEN_IDS = 256
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # OpenAI's penalties and biases (engine/penalties.py applies them, batched).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: >1 discourages tokens of prompt and output
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Top log-probabilities per generated token (0: the chosen token's only); None: off.
    logprobs: int | None = None
    # Top log-probabilities per prompt token (echo, vLLM's prompt_logprobs); None: off.
    prompt_logprobs: int | None = None
    # Structured output spec (engine/structured.py), e.g. {"type": "json_schema", ...}.
    structured: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        # Below this, sampling is greedy in all but rounding (and logits / T overflows).
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Range-check every field (the engine sees nothing unchecked); ``vocab_size``,
        when known, bounds ``stop_token_ids`` and ``logit_bias``. Raises InvalidParameter."""
        if _common_ok(self):  # every check below passes: the router's hot path, one call
            return self
        _check_counts(self)
        _check_floats(self)
        _check_stops(self, vocab_size)
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        self._validate_extras(need)
        if vocab_size is not None and isinstance(self.logit_bias, dict):
            need(
                all(k < vocab_size for k in self.logit_bias),
                "logit_bias",
                f"keys must be token ids below the vocabulary size {vocab_size}",
            )
        return self

    def _validate_extras(self, need: Any) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(_is_num(value), name, "must be a number")
            need(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        rep = self.repetition_penalty
        need(_is_num(rep), "repetition_penalty", "must be a number")
        need(0.0 < rep <= 10.0, "repetition_penalty", f"must be in (0, 10], got {rep}")
        need(_is_num(self.min_p), "min_p", "must be a number")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        bias = self.logit_bias
        need(isinstance(bias, dict), "logit_bias", "must map token ids to numbers")
        need(len(bias) <= 1024, "logit_bias", "may hold at most 1024 entries")
        need(all(_is_int(k) and k >= 0 for k in bias), "logit_bias", "keys must be token ids")
        need(
            all(_is_num(v) and -100.0 <= v <= 100.0 for v in bias.values()),
            "logit_bias",
            "values must be numbers in [-100, 100]",
        )
        lp = self.logprobs
        need(lp is None or (_is_int(lp) and 0 <= lp <= 20), "logprobs", "must be in [0, 20]")
        plp = self.prompt_logprobs
        need(
            plp is None or (_is_int(plp) and 0 <= plp <= 20),
            "prompt_logprobs",
            "must be in [0, 20]",
        )
        spec = self.structured
        need(spec is None or isinstance(spec, dict), "structured", "must be an object")
        if spec is not None:
            param = str(spec.get("param") or "structured")
            need(not self.ignore_eos, param, "cannot be combined with ignore_eos")
            need(self.min_tokens == 0, param, "cannot be combined with min_tokens")

    def to_dict(self) -> dict[str, Any]:
        """As ``dataclasses.asdict`` (containers copied), without its deep walk: that walk
        cost the router more than the rest of encoding a request (bench/router_throughput.py)."""
        return {name: _copied(getattr(self, name)) for name in _NAMES}

    @once
    def wire(self) -> dict[str, Any]:
        """The fields as the codec writes them (``to_dict`` without its copies), built once
        per instance: it is frozen, and a P/D request is encoded twice (its prefill and its
        decode worker's message). Shared: read it, never change it."""
        return {name: getattr(self, name) for name in _NAMES}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> SamplingParams:
        known = {k: v for k, v in body.items() if k in cls.__dataclass_fields__}
        unknown = set(body) - set(known)
        if unknown:
            raise InvalidParameter(
                sorted(unknown)[0], f"unknown sampling parameter {sorted(unknown)}"
            )
        if isinstance(known.get("stop"), str):
            known["stop"] = [known["stop"]]
        if known.get("stop") is None:
            known.pop("stop", None)
        if isinstance(known.get("logit_bias"), dict):  # JSON object keys are strings
            known["logit_bias"] = _int_keys(known["logit_bias"])
        return cls(**known).validate()


_NUM = frozenset({int, float})


def _common_ok(p: SamplingParams) -> bool:
    """True only for parameters that ``validate`` accepts whatever the vocabulary: plain
    ints and floats in range, no stop strings or ids, no bias, no structured output (most
    requests). False sends them through the checks that name the field at fault."""
    mt, mn, seed = p.max_tokens, p.min_tokens, p.seed
    lp, plp = p.logprobs, p.prompt_logprobs
    return (
        type(mt) is int
        and type(mn) is int
        and type(p.top_k) is int
        and 0 <= mn <= mt <= MAX_TOKENS
        and mt >= 1
        and -1 <= p.top_k <= MAX_TOP_K
        and (seed is None or (type(seed) is int and SEED_MIN <= seed <= SEED_MAX))
        and {
            type(p.temperature),
            type(p.top_p),
            type(p.presence_penalty),
            type(p.frequency_penalty),
            type(p.repetition_penalty),
            type(p.min_p),
        }
        <= _NUM
        and 0.0 <= p.temperature <= 100.0
        and 0.0 < p.top_p <= 1.0
        and -2.0 <= p.presence_penalty <= 2.0
        and -2.0 <= p.frequency_penalty <= 2.0
        and 0.0 < p.repetition_penalty <= 10.0
        and 0.0 <= p.min_p <= 1.0
        and type(p.stop) is list
        and not p.stop
        and type(p.stop_token_ids) is list
        and not p.stop_token_ids
        and type(p.logit_bias) is dict
        and not p.logit_bias
        and (p.ignore_eos is True or p.ignore_eos is False)
        and (lp is None or (type(lp) is int and 0 <= lp <= 20))
        and (plp is None or (type(plp) is int and 0 <= plp <= 20))
        and p.structured is None
    )


def need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise InvalidParameter(name, f"{name} {msg}")


def _check_counts(p: SamplingParams) -> None:
    for name in ("max_tokens", "min_tokens"):
        value = getattr(p, name)
        need(_is_int(value), name, "must be an integer")
        need(value <= MAX_TOKENS, name, f"must be at most {MAX_TOKENS}, got {value}")
    need(p.max_tokens >= 1, "max_tokens", f"must be at least 1, got {p.max_tokens}")
    need(p.min_tokens >= 0, "min_tokens", f"must be >= 0, got {p.min_tokens}")
    need(
        p.min_tokens <= p.max_tokens,
        "min_tokens",
        f"({p.min_tokens}) must not exceed max_tokens ({p.max_tokens})",
    )
    need(_is_int(p.top_k), "top_k", "must be an integer")
    need(-1 <= p.top_k <= MAX_TOP_K, "top_k", f"must be -1, 0 or in [1, {MAX_TOP_K}]")
    if p.seed is not None:
        need(_is_int(p.seed), "seed", "must be an integer")
        need(SEED_MIN <= p.seed <= SEED_MAX, "seed", f"must be in [{SEED_MIN}, {SEED_MAX}]")


def _check_floats(p: SamplingParams) -> None:
    need(_is_num(p.temperature), "temperature", "must be a number")
    need(0.0 <= p.temperature <= 100.0, "temperature", f"must be in [0, 100], got {p.temperature}")
    need(_is_num(p.top_p), "top_p", "must be a number")
    need(0.0 < p.top_p <= 1.0, "top_p", f"must be in (0, 1], got {p.top_p}")


def _check_stops(p: SamplingParams, vocab_size: int | None) -> None:
    need(isinstance(p.stop, list), "stop", "must be a string or a list of strings")
    need(len(p.stop) <= MAX_STOP, "stop", f"may hold at most {MAX_STOP} strings")
    need(all(isinstance(s, str) and s for s in p.stop), "stop", "must be non-empty strings")
    need(
        all(len(s) <= MAX_STOP_CHARS for s in p.stop),
        "stop",
        f"strings may be at most {MAX_STOP_CHARS} characters long",
    )
    need(all(valid_text(s) for s in p.stop), "stop", "must be valid Unicode (no lone surrogates)")
    ids = p.stop_token_ids
    need(
        isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS,
        "stop_token_ids",
        f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
    )
    need(all(_is_int(t) and t >= 0 for t in ids), "stop_token_ids", "must be non-negative integers")
    if vocab_size is not None:
        need(
            all(t < vocab_size for t in ids),
            "stop_token_ids",
            f"must be token ids below the vocabulary size {vocab_size}",
        )


def valid_text(s: str) -> bool:
    """True when ``s`` is encodable Unicode: a lone surrogate (JSON lets ``\\ud800``
    through) breaks tokenizers and every UTF-8 writer downstream."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int_keys(bias: dict[Any, Any]) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except (TypeError, ValueError):
            raise InvalidParameter(
                "logit_bias", f"logit_bias key {key!r} is not a token id"
            ) from None
    return out


_NAMES = tuple(f.name for f in fields(SamplingParams))
_SCALARS = frozenset({int, float, str, bool, type(None)})


def _copied(value: Any) -> Any:
    """A copy of a field's value as ``asdict`` gives it: flat lists and dicts of scalars
    (stop, stop_token_ids, logit_bias) copied shallowly, anything deeper deep-copied."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list and all(type(v) in _SCALARS for v in value):
        return list(value)
    if kind is dict and all(type(v) in _SCALARS for v in value.values()):
        return dict(value)
    return copy.deepcopy(value)
