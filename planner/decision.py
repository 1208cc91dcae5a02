"""The planner's output (a decision) and its carried state, both plain dataclasses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pdserve.planner.forecast import Forecast


@dataclass(frozen=True)
class PoolDecision:
    role: str  # "prefill" | "decode"
    current: int
    desired: int
    need: float  # replicas the load model asks for, before stability rules
    remove_unready: int = 0  # of a scale-down, how many are unready pods (removed first)
    reason: str = ""

    @property
    def changed(self) -> bool:
        return self.desired != self.current


@dataclass(frozen=True)
class Decision:
    time_s: float
    prefill: PoolDecision
    decode: PoolDecision
    details: dict[str, float] = field(default_factory=dict)  # model terms, for status/logs
    mode: str = "disaggregated"  # or "colocated": no prefill pool, decode workers prefill
    mix_reason: str = ""  # why this mode (goodput per replica of both)

    @property
    def reason(self) -> str:
        return (
            f"prefill: {self.prefill.reason}; decode: {self.decode.reason}; mix: {self.mix_reason}"
        )

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["reason"] = self.reason
        return body


@dataclass(frozen=True)
class PoolMemory:
    """What the planner remembers about one pool between decisions."""

    last_target: int | None = None  # what it last set (to detect manual edits)
    last_scale_s: float | None = None  # when it last changed the count (or saw an edit)
    last_up_s: float | None = None
    history: tuple[tuple[float, int], ...] = ()  # (time, recommendation) in the window
    etas: tuple[float, ...] = ()  # expected ready times of the pods it started (not yet ready)
    below_since: float | None = None  # since when the need has stayed below the count


@dataclass(frozen=True)
class PlannerState:
    """Carried from one decision to the next; JSON-safe via to_dict/from_dict."""

    prefill: PoolMemory = field(default_factory=PoolMemory)
    decode: PoolMemory = field(default_factory=PoolMemory)
    prefill_correction: float = 1.0  # smoothed observed / predicted prefill time
    decode_correction: float = 1.0  # smoothed observed / predicted decode step time
    forecast: Forecast = field(default_factory=Forecast)  # load trend and seasonality
    mode: str = "disaggregated"  # the P:D decision in force (see mix.py)
    # the last interval's prefill queue depth and ready prefill replicas (the prefill
    # correction learns from throughput while the queue waits: model.py)
    prefill_queue_depth: float = 0.0
    prefill_ready: int = 0

    def with_pool(self, role: str, memory: PoolMemory) -> PlannerState:
        assert role in ("prefill", "decode"), role
        if role == "prefill":
            return replace(self, prefill=memory)
        return replace(self, decode=memory)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["forecast"] = self.forecast.to_dict()
        return body

    @classmethod
    def from_dict(cls, body: Any) -> PlannerState:
        if not isinstance(body, dict):
            return cls()
        try:
            return cls(
                prefill=_memory(body.get("prefill")),
                decode=_memory(body.get("decode")),
                prefill_correction=float(body.get("prefill_correction", 1.0)),
                decode_correction=float(body.get("decode_correction", 1.0)),
                forecast=Forecast.from_dict(body.get("forecast")),
                mode=str(body.get("mode", "disaggregated")),
                prefill_queue_depth=float(body.get("prefill_queue_depth", 0.0)),
                prefill_ready=int(body.get("prefill_ready", 0)),
            )
        except (TypeError, ValueError):
            return cls()  # a corrupt stored state only costs the smoothing history


def _memory(body: Any) -> PoolMemory:
    if not isinstance(body, dict):
        return PoolMemory()
    last_target = body.get("last_target")
    return PoolMemory(
        last_target=None if last_target is None else int(last_target),
        last_scale_s=_opt_float(body.get("last_scale_s")),
        last_up_s=_opt_float(body.get("last_up_s")),
        history=tuple((float(t), int(n)) for t, n in body.get("history", ())),
        etas=tuple(float(t) for t in body.get("etas", ())),
        below_since=_opt_float(body.get("below_since")),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)
