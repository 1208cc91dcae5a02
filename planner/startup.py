"""How long a new worker takes to serve, learned from the workers the planner saw start.

The planner sizes each pool for ``now + startup_s`` and credits starting pods from
their expected ready time (ahead.py), so ``startup_s`` must be the start-up the
cluster really has, not a guess: on the shared 2-core machine a tiny-model worker
took 36-92 s from spawn to ``/health`` 200 (model load, torch warm-up) while
``--worker-startup`` said 8 s, and the planner ordered workers for a queue that
its one ready worker had drained long before they were ready, then stopped them
unready (each one cost a third of a core while it loaded).

``StartupEstimate`` keeps, per pool, the last ``keep`` observed start-ups (spawn to
first ready) and gives their mean; with none yet, the configured prior. The
planner takes the larger of the two pools' estimates (one horizon for both pools:
the same worker binary loads the same model). A worker stopped before it was ready
says its start-up is at least its age: such a censored observation raises the
estimate to that age when the mean is below it, never lowers it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


@dataclass
class StartupEstimate:
    prior_s: float  # what the operator configured (--worker-startup): used until measured
    keep: int = 5  # a running mean over this many recent start-ups per pool
    _seen: dict[str, deque[float]] = field(default_factory=dict)
    _floor: dict[str, float] = field(default_factory=dict)  # from censored observations

    def __post_init__(self) -> None:
        if self.prior_s < 0 or self.keep < 1:
            raise ValueError(f"need prior_s >= 0 and keep >= 1, got {self.prior_s}, {self.keep}")

    def observe(self, role: str, seconds: float) -> None:
        """A worker of ``role`` became ready ``seconds`` after it was spawned."""
        assert role in ROLES, role
        if seconds >= 0:
            self._seen.setdefault(role, deque(maxlen=self.keep)).append(seconds)
            self._floor.pop(role, None)  # a completed start-up supersedes the bound

    def stopped_unready(self, role: str, age_s: float) -> None:
        """A worker of ``role`` was stopped ``age_s`` after its spawn, never ready."""
        assert role in ROLES, role
        self._floor[role] = max(self._floor.get(role, 0.0), age_s)

    def observed(self, role: str) -> int:
        return len(self._seen.get(role, ()))

    def estimate(self, role: str) -> float:
        seen = self._seen.get(role)
        mean = sum(seen) / len(seen) if seen else self.prior_s
        return max(mean, self._floor.get(role, 0.0))

    def planner_startup_s(self) -> float:
        """The planner's ``startup_s``: the slower pool's estimate."""
        return max(self.estimate(role) for role in ROLES)

    def describe(self) -> str:
        parts = [
            f"{role} {self.estimate(role):.1f}s ({self.observed(role)} measured)" for role in ROLES
        ]
        return "start-up estimate " + ", ".join(parts)
