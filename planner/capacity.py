"""Per-replica capacity model (the profile) and its JSON form.

A profile holds the cost coefficients that ``pdserve profile`` measures on the
deployed model. Prefill time of one prompt of ``L`` tokens, in chunks of at most
``chunk_tokens``::

    prefill_time(L) = chunk_overhead_s * ceil(L / chunk_tokens) + L / tokens_per_s
                      + attention_s_per_token_sq * L**2

One decode step over a batch of ``B`` sequences with mean context ``C``::

    step_time(B, C) = step_base_s + step_per_seq_s * B + step_per_kv_token_s * B * C
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file is missing, unreadable or has invalid fields."""


@dataclass(frozen=True)
class PrefillProfile:
    chunk_overhead_s: float  # fixed cost of one prefill step (scheduling, launches)
    tokens_per_s: float  # marginal prompt-token throughput of one replica
    chunk_tokens: int  # token budget of one step (--max-num-batched-tokens)
    attention_s_per_token_sq: float = 0.0  # quadratic attention cost
    source: str = ""  # where these numbers come from (measured how / published where)

    def service_time(self, prompt_tokens: float) -> float:
        """Seconds to prefill one prompt alone on an idle replica."""
        chunks = max(1, math.ceil(prompt_tokens / self.chunk_tokens))
        return (
            self.chunk_overhead_s * chunks
            + prompt_tokens / self.tokens_per_s
            + self.attention_s_per_token_sq * prompt_tokens**2
        )

    def saturated_tokens_per_s(self, mean_prompt: float) -> float:
        """Prompt tokens per second of one busy replica (full chunks) at this prompt length."""
        per_token = (
            self.chunk_overhead_s / self.chunk_tokens
            + 1.0 / self.tokens_per_s
            + self.attention_s_per_token_sq * mean_prompt
        )
        return 1.0 / per_token


@dataclass(frozen=True)
class DecodeProfile:
    step_base_s: float  # weights read + launch overhead of one step
    step_per_seq_s: float  # per sequence in the batch
    step_per_kv_token_s: float  # per context token attended (KV read)
    max_num_seqs: int  # engine batch limit (--max-num-seqs)
    kv_capacity_tokens: int  # KV pool size of one replica, in tokens
    source: str = ""  # where these numbers come from

    def step_time(self, batch: float, mean_context: float) -> float:
        return (
            self.step_base_s
            + self.step_per_seq_s * batch
            + self.step_per_kv_token_s * batch * mean_context
        )

    def max_batch_at(self, step_budget_s: float, mean_context: float) -> float:
        """Largest batch whose step time stays within ``step_budget_s`` (>= 1)."""
        per_seq = self.step_per_seq_s + self.step_per_kv_token_s * mean_context
        batch = (step_budget_s - self.step_base_s) / per_seq if per_seq > 0 else math.inf
        return max(1.0, min(float(self.max_num_seqs), batch))


@dataclass(frozen=True)
class Profile:
    """Measured capacities of one prefill replica and one decode replica."""

    model: str
    hardware: str
    prefill: PrefillProfile
    decode: DecodeProfile
    version: int = PROFILE_VERSION
    source: str = ""  # e.g. "measured: pdserve profile ... on <host>, <date>" or "estimate: ..."
    # a new replica's time to serve (the simulator's pod start-up), and where it comes from;
    # None: not given (the simulator then uses its own default and says so)
    startup_s: float | None = None
    startup_source: str = ""

    def __post_init__(self) -> None:
        p, d = self.prefill, self.decode
        _need(self.startup_s is None or self.startup_s >= 0, "startup_s must be >= 0")
        _need(p.tokens_per_s > 0, "prefill.tokens_per_s must be > 0")
        _need(p.chunk_tokens > 0, "prefill.chunk_tokens must be > 0")
        _need(p.chunk_overhead_s >= 0, "prefill.chunk_overhead_s must be >= 0")
        _need(p.attention_s_per_token_sq >= 0, "prefill.attention_s_per_token_sq must be >= 0")
        _need(d.step_base_s >= 0, "decode.step_base_s must be >= 0")
        _need(d.step_per_seq_s >= 0, "decode.step_per_seq_s must be >= 0")
        _need(d.step_per_kv_token_s >= 0, "decode.step_per_kv_token_s must be >= 0")
        _need(d.step_time(1, 1) > 0, "decode step time must be > 0")
        _need(d.max_num_seqs > 0, "decode.max_num_seqs must be > 0")
        _need(d.kv_capacity_tokens > 0, "decode.kv_capacity_tokens must be > 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: Any) -> Profile:
        if not isinstance(body, dict):
            raise ProfileError("profile must be a JSON object")
        version = body.get("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise ProfileError(f"profile version {version} unsupported (want {PROFILE_VERSION})")
        return cls(
            model=str(body.get("model", "")),
            hardware=str(body.get("hardware", "")),
            prefill=_section(PrefillProfile, body, "prefill"),
            decode=_section(DecodeProfile, body, "decode"),
            source=str(body.get("source", "")),
            startup_s=_opt_seconds(body.get("startup_s")),
            startup_source=str(body.get("startup_source", "")),
        )


def _opt_seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"profile.startup_s must be a number, got {value!r}")
    return float(value)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ProfileError(message)


def _section(cls: type, body: dict[str, Any], name: str) -> Any:
    section = body.get(name)
    if not isinstance(section, dict):
        raise ProfileError(f"profile: '{name}' must be an object")
    known = {f.name: f for f in fields(cls)}
    unknown = set(section) - set(known)
    if unknown:
        raise ProfileError(f"profile.{name}: unknown fields {sorted(unknown)}")
    values: dict[str, Any] = {}
    for key, f in known.items():
        if key not in section:
            if f.default is MISSING:
                raise ProfileError(f"profile.{name}: missing field '{key}'")
            continue
        value = section[key]
        if f.type == "str":
            if not isinstance(value, str):
                raise ProfileError(f"profile.{name}.{key} must be a string, got {value!r}")
            values[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProfileError(f"profile.{name}.{key} must be a number, got {value!r}")
        values[key] = int(value) if f.type == "int" else float(value)
    return cls(**values)


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


def load_profile(path: str | Path) -> Profile:
    try:
        body = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ProfileError(f"profile file {path} not found") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    return Profile.from_dict(body)
