"""Planner configuration: SLOs, bounds and stability knobs (frozen)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner.capacity import Profile
from pdserve.planner.forecast import ForecastConfig
from pdserve.planner.tail import tpot_scale, ttft_scale


class PlannerConfigError(ValueError):
    """Invalid planner configuration (bad SLO, bounds or knob)."""


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # time to first token target
    tpot_s: float  # time per output token target
    # share of requests that must meet both targets (spec.slo.targetAttainment): the
    # percentile the planner sizes for (0.9: p90 of TTFT and TPOT; 0.99: p99)
    target_attainment: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise PlannerConfigError(f"SLO targets must be > 0, got {self}")
        if not 0.5 <= self.target_attainment <= 1:
            raise PlannerConfigError(f"target_attainment must be in [0.5, 1], got {self}")


@dataclass(frozen=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise PlannerConfigError(
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True)
class Stability:
    """How fast the planner moves. Scale up fast, scale down slow."""

    scale_down_window_s: float = 300.0  # scale down to the max recommendation of this window
    scale_down_cooldown_s: float = 60.0  # no scale-down this soon after any scale event
    scale_up_cooldown_s: float = 0.0  # no scale-up this soon after a scale-up
    tolerance: float = 0.1  # ignore changes of less than this fraction of current
    max_up_factor: float = 4.0  # at most x4 per decision ...
    min_up_step: int = 4  # ... or +4, whichever is larger
    max_down_step_fraction: float = 0.5  # at most -50% per decision (at least -1)
    # hysteresis for pods still starting: a scale-down that would cancel one waits until
    # the need (the forecast for their ready time) has stayed below the count this long,
    # so one interval's dip does not undo an order placed seconds before (0: no hold)
    unready_hold_s: float = 0.0


@dataclass(frozen=True)
class PlannerConfig:
    slo: SLO
    profile: Profile
    prefill: Bounds = field(default_factory=Bounds)
    decode: Bounds = field(default_factory=Bounds)
    stability: Stability = field(default_factory=Stability)
    # fraction of the TTFT target that the modelled mean TTFT may use at a p90 target
    # (the rest covers the tail: the SLO is on a percentile, the model gives the mean);
    # other targets scale it (tail.py): use ttft_budget_s, not this, to plan
    ttft_headroom: float = 0.5
    tpot_headroom: float = 0.8  # same for the decode step time vs the TPOT target
    max_prefill_utilisation: float = 0.85  # never plan a prefill replica busier than this
    min_prefill_utilisation: float = 0.1
    kv_target_utilisation: float = 0.85  # KV tokens used / KV capacity to plan for
    decode_batch_utilisation: float = 0.9  # plan batches this far below the limit at the SLO
    queue_aware: bool = True  # False: the queue-blind baseline (no queue-wait term)
    queue_drain_s: float = 30.0  # drain the prefill backlog within this many seconds
    # a pod ordered now serves this much later (scheduling, image, weights, warm-up): the
    # pools are sized for then, and pods already starting are credited from their ETA
    startup_s: float = 30.0
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    correction_alpha: float = 0.3  # EWMA weight of a new observed/predicted ratio
    correction_bounds: tuple[float, float] = (0.5, 4.0)
    min_requests_for_correction: int = 20  # per interval, else keep the old factor

    def __post_init__(self) -> None:
        if not 0 < self.ttft_headroom <= 1 or not 0 < self.tpot_headroom <= 1:
            raise PlannerConfigError("headrooms must be in (0, 1]")
        if not 0 < self.min_prefill_utilisation <= self.max_prefill_utilisation < 1:
            raise PlannerConfigError("need 0 < min_prefill_utilisation <= max < 1")
        if not 0 < self.kv_target_utilisation <= 1 or not 0 < self.decode_batch_utilisation <= 1:
            raise PlannerConfigError("kv_target/decode_batch utilisation must be in (0, 1]")
        if self.queue_drain_s <= 0:
            raise PlannerConfigError("queue_drain_s must be > 0")
        if self.startup_s < 0 or self.forecast.max_growth < 1:
            raise PlannerConfigError("need startup_s >= 0 and forecast.max_growth >= 1")
        lo, hi = self.correction_bounds
        if not 0 < lo <= 1 <= hi:
            raise PlannerConfigError("correction_bounds must satisfy 0 < lo <= 1 <= hi")

    @property
    def ttft_budget_s(self) -> float:
        """What the modelled mean TTFT may reach so that the target percentile meets the SLO."""
        return self.ttft_headroom * ttft_scale(self.slo.target_attainment) * self.slo.ttft_s

    @property
    def tpot_budget_s(self) -> float:
        """Same for the decode step time against the TPOT target."""
        return self.tpot_headroom * tpot_scale(self.slo.target_attainment) * self.slo.tpot_s
