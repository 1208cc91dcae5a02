"""Per-request sampling parameters, validated at the edge.

``SamplingParams.validate`` raises :class:`InvalidParameter` naming the field;
the router maps it to an OpenAI 400 with ``param`` set, the workers do the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class InvalidParameter(ValueError):
    """A request parameter is invalid. ``field`` names it (OpenAI's ``param``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


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
    # Structured output spec (engine/structured.py), e.g. {"type": "json_schema", ...}.
    structured: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def validate(self) -> SamplingParams:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise InvalidParameter(name, f"{name} {msg}")

        need(_is_int(self.max_tokens), "max_tokens", "must be an integer")
        need(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        need(_is_num(self.temperature), "temperature", "must be a number")
        need(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be in [0, 100], got {self.temperature}",
        )
        need(_is_num(self.top_p), "top_p", "must be a number")
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(_is_int(self.top_k), "top_k", "must be an integer")
        need(self.top_k >= -1, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        need(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        need(isinstance(self.stop, list), "stop", "must be a string or a list of strings")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "may hold at most 16 strings")
        need(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        need(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        self._validate_extras(need)
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
        spec = self.structured
        need(spec is None or isinstance(spec, dict), "structured", "must be an object")
        if spec is not None:
            param = str(spec.get("param") or "structured")
            need(not self.ignore_eos, param, "cannot be combined with ignore_eos")
            need(self.min_tokens == 0, param, "cannot be combined with min_tokens")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
