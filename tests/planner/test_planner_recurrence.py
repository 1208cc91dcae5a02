"""planner/recurrence.py: a period found in the load itself (waves every few minutes, which
no daily season bins), and no period where there is none (a ramp, one burst, noise)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.planner import recurrence
from pdserve.planner.forecast import ForecastConfig, Series
from pdserve.planner.recurrence import Recurrence

pytestmark = pytest.mark.unit

INTERVAL = 5.0
CFG = ForecastConfig()


def waves(t: float, period: float = 720.0, length: float = 240.0, start: float = 360.0) -> float:
    """100 requests/s, +60 in waves of ``length`` every ``period`` from ``start``."""
    on = t >= start and (t - start) % period < length
    return 100.0 + (60.0 if on else 0.0)


def feed(load, until: float, noise: float = 0.0, seed: int = 0) -> Recurrence:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    r, t = Recurrence(), INTERVAL
    while t <= until:
        r = r.observe(t, load(t) * (1 + noise * rng.standard_normal()))
        t += INTERVAL
    return r


def test_waves_every_12_minutes_are_found_from_their_third() -> None:
    early = feed(waves, 360.0 + 720.0 + 300.0, noise=0.02)  # two waves seen
    assert early.period == 0  # one period compared with nothing
    r = feed(waves, 360.0 + 2 * 720.0 - 30.0, noise=0.02)  # 30 s before the third wave
    assert r.period == 12
    # one period ago the load rose by the wave's height within the next minute
    assert r.delta(360.0 + 2 * 720.0 - 30.0, 60.0) == pytest.approx(60.0, rel=0.25)
    assert abs(r.delta(360.0 + 2 * 720.0 - 300.0, 60.0) or 0.0) < 10.0  # mid-gap: flat


@pytest.mark.parametrize(
    "load",
    [
        lambda t: 50.0 + 0.05 * t,  # a ramp correlates with itself shifted; its changes do not
        lambda t: 500.0 if 900.0 <= t < 1500.0 else 50.0,  # one burst, held 10 minutes
        lambda t: 300 - 200 * math.cos(2 * math.pi * t / 7200.0),  # a smooth day
        lambda t: 100.0,  # flat (with noise below)
    ],
)
def test_no_period_where_nothing_recurs(load) -> None:  # type: ignore[no-untyped-def]
    r = feed(load, 7200.0, noise=0.03, seed=1)
    assert r.period == 0, r.period


def test_the_forecast_anticipates_the_next_wave() -> None:
    s, t = Series(), INTERVAL
    before = 360.0 + 3 * 720.0 - 30.0  # 30 s before the fourth wave
    while t <= before:
        s = s.observe(t, waves(t), INTERVAL, CFG, count=waves(t) * INTERVAL)
        t += INTERVAL
    assert s.level == pytest.approx(100.0)
    assert s.peak(60.0, CFG) == pytest.approx(160.0, rel=0.05)  # the wave, before it starts
    plain = Series(**{**s.__dict__, "recurrence": Recurrence()})
    assert plain.peak(60.0, CFG) == pytest.approx(100.0, rel=0.05)  # without it: the level


def test_state_is_small_and_round_trips() -> None:
    r = feed(waves, 3 * 3600.0)
    assert len(r.means) == recurrence.KEEP  # two hours of minutes, no more
    assert recurrence.from_dict(json.loads(json.dumps(recurrence.to_dict(r)))) == r
    assert recurrence.from_dict({"means": [float("nan")]}) == Recurrence()
    assert recurrence.from_dict({"means": "x", "period": "y"}) == Recurrence()
    assert recurrence.from_dict(None) == Recurrence()
