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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
        return self

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
        return cls(**known).validate()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
