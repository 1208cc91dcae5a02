"""A load pattern that recurs with a period no calendar names: found in the last hours.

A batch job every 12 minutes, an hourly cron, a report every half hour: each wave starts
within seconds, faster than a pod starts, so a reactive planner loses every wave's first
minute. ``season`` (forecast.py) bins a fixed period (a day); this finds the period from
the load itself. The series is kept as per-minute means (at most ``KEEP`` minutes: the
state stays small, it is carried in the LLMService's status). At each new minute the
period is looked for in the *changes* from minute to minute, not in the levels (a ramp
correlates with itself shifted by any lag; its changes are flat): a lag ``p`` of 3 to
``KEEP / 2`` minutes is the period when the last ``p`` minutes' changes correlate with
the ``p`` before them at ``MIN_R`` or more, and the last period held a change beyond the
noise. ``delta(t, h)`` is then what the load did one period ago between ``t - p`` and
``t + h - p``: the forecast takes it as it takes the daily season's.

One period of history is compared with the one before it, so a pattern is used from its
third occurrence on; a load with no recurrence (a ramp, a single burst, noise) finds no
lag that correlates, and the forecast is as before.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

MINUTE_S = 60.0
KEEP = 120  # minutes of per-minute means kept
MIN_LAG = 3  # minutes: below this a "period" is the noise of a few intervals
MIN_R = 0.8  # correlation of one period's changes with the period before
MIN_CHANGE = 0.15  # the last period's largest change, relative to its mean level


@dataclass(frozen=True)
class Recurrence:
    first_minute: int = 0  # the minute index (t // 60) of means[0]
    means: tuple[float, ...] = ()  # completed minutes' means, oldest first
    minute: int | None = None  # the minute being accumulated
    total: float = 0.0
    count: int = 0
    period: int = 0  # minutes; 0: none found

    def observe(self, t: float, value: float) -> Recurrence:
        k = int(t // MINUTE_S)
        if self.minute is None:
            return replace(self, first_minute=k, minute=k, total=value, count=1)
        if k == self.minute:
            return replace(self, total=self.total + value, count=self.count + 1)
        if k < self.minute:  # the clock went back (a restored state): start over
            return Recurrence().observe(t, value)
        means = list(self.means)
        first = self.first_minute if means else self.minute
        means.append(self.total / max(self.count, 1))
        # a gap (no observation for whole minutes) is filled with the last mean
        means += [means[-1]] * (k - self.minute - 1)
        drop = max(0, len(means) - KEEP)
        means = means[drop:]
        first += drop
        return Recurrence(first, tuple(means), k, value, 1, find_period(means))

    def delta(self, t: float, horizon_s: float) -> float | None:
        """What the load did one period ago from ``t`` to ``t + horizon_s``; None without a
        period or without those minutes."""
        if self.period <= 0 or not self.means:
            return None
        now = self._at(t - self.period * MINUTE_S)
        then = self._at(t + horizon_s - self.period * MINUTE_S)
        return None if now is None or then is None else then - now

    def _at(self, t: float) -> float | None:
        i = int(t // MINUTE_S) - self.first_minute
        return self.means[i] if 0 <= i < len(self.means) else None


def find_period(means: list[float] | tuple[float, ...]) -> int:
    """The lag in minutes (0: none) whose last period of minute-to-minute changes repeats
    the period before it (``MIN_R``), the shortest of the best when several do."""
    diffs = [b - a for a, b in itertools.pairwise(means)]
    best, best_r = 0, MIN_R
    for p in range(MIN_LAG, len(diffs) // 2 + 1):
        last, before = diffs[-p:], diffs[-2 * p : -p]
        level = sum(means[-p:]) / p
        if level <= 0 or max(abs(d) for d in last) < MIN_CHANGE * level:
            continue
        r = _pearson(last, before)
        if r > best_r + 0.02:  # a multiple of the period correlates as well: keep the first
            best, best_r = p, r
    return best


def _pearson(a: list[float], b: list[float]) -> float:
    n = len(a)
    ma, mb = sum(a) / n, sum(b) / n
    sa = math.sqrt(sum((x - ma) ** 2 for x in a))
    sb = math.sqrt(sum((y - mb) ** 2 for y in b))
    if sa == 0 or sb == 0:
        return 0.0
    return sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / (sa * sb)


def to_dict(r: Recurrence) -> dict[str, Any]:
    return {
        "first_minute": r.first_minute,
        "means": list(r.means),
        "minute": r.minute,
        "total": r.total,
        "count": r.count,
        "period": r.period,
    }


def from_dict(body: Any) -> Recurrence:
    if not isinstance(body, dict):
        return Recurrence()
    try:
        means = tuple(float(x) for x in body.get("means", ()))[-KEEP:]
        minute = body.get("minute")
        out = Recurrence(
            int(body.get("first_minute", 0)),
            means,
            None if minute is None else int(minute),
            float(body.get("total", 0.0)),
            int(body.get("count", 0)),
            int(body.get("period", 0)),
        )
    except (TypeError, ValueError):
        return Recurrence()
    ok = all(math.isfinite(x) for x in (*out.means, out.total))
    return out if ok else Recurrence()
