"""The short-horizon load forecast: trend, noise, daily seasonality, JSON state."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdserve.planner.forecast import Forecast, ForecastConfig, Series

pytestmark = pytest.mark.unit

CFG = ForecastConfig()


def feed(values: list[float], interval: float = 10.0, t0: float = 0.0) -> Series:
    s = Series()
    for i, v in enumerate(values):
        s = s.observe(t0 + interval * (i + 1), v, interval, CFG, count=v * interval)
    return s


def test_poisson_noise_is_not_a_trend() -> None:
    rng = np.random.default_rng(1)
    s, false_rises = Series(), 0
    for i in range(300):
        v = rng.poisson(50 * 10) / 10  # 50 req/s counted over 10 s
        s = s.observe(10.0 * (i + 1), v, 10.0, CFG, count=v * 10)
        false_rises += s.slope > 0
    assert false_rises <= 3, false_rises
    assert s.at(60.0, CFG) == pytest.approx(s.level)


def test_a_ramp_is_forecast_from_its_first_interval() -> None:
    s = feed([100.0] * 10 + [150.0])  # +5 req/s per second
    assert s.slope == pytest.approx(5.0)
    # the interval mean lags the rate at its end by half an interval
    assert s.at(5.0, CFG) == pytest.approx(150 + 5 * (5 + 5))
    # one rising interval may be a step: the forecast grows at most young_growth ...
    assert s.at(30.0, CFG) == pytest.approx(150 * CFG.young_growth)
    flat = s.observe(120.0, 151.0, 10.0, CFG, count=1510)
    assert flat.slope == 0.0  # the rise stopped: no more extrapolation
    # ... a ramp that goes on rising is extrapolated over the horizon, bounded
    ramp = feed([100.0] * 10 + [150.0, 200.0, 250.0])
    assert ramp.rises == CFG.trend_after
    assert ramp.at(30.0, CFG) == pytest.approx(250 + 5 * (30 + 5))
    assert ramp.at(1000.0, CFG) == 250 * CFG.max_growth


@pytest.mark.parametrize("smeared", [False, True])
def test_a_step_is_scaled_for_its_level_not_for_a_trend(smeared: bool) -> None:
    """A load step x6 (2 -> 12 req/s, 2 s intervals): the interval it falls inside sees
    part of it, so a step shows as one or two rising intervals, never three. Its
    forecast over a 28 s start-up stays within young_growth of the level (it was 4x:
    the planner ordered a pair of workers it then cancelled unready)."""
    low = [2.0] * 15
    values = [*low, 5.0, 12.0, 12.0] if smeared else [*low, 12.0, 12.0]
    s = Series()
    for i, v in enumerate(values):
        s = s.observe(2.0 * (i + 1), v, 2.0, CFG, count=v * 2.0)
        if v == 12.0 and s.rises:
            assert s.at(28.0, CFG) <= 12.0 * CFG.young_growth + 1e-9
    assert s.slope == 0.0 and s.at(28.0, CFG) == pytest.approx(12.0)


def test_token_series_needs_two_rising_intervals() -> None:
    f = Forecast()
    for i in range(10):
        f = f.observe(10.0 * (i + 1), 10.0, (100.0, 1e5, 5e4), CFG)
    once = f.observe(110.0, 10.0, (100.0, 2e5, 5e4), CFG)  # prompt tokens double, requests flat
    assert once.prompt_rate.slope == 0.0  # heavy-tailed sums: one interval may be an outlier
    twice = once.observe(120.0, 10.0, (100.0, 3e5, 5e4), CFG)
    assert twice.prompt_rate.slope > 0
    assert twice.prompt_demand_at(30.0, CFG) > 3e5


def test_a_ramp_within_the_per_step_noise_is_seen_by_its_fitted_slope() -> None:
    """Prompt tokens of a long-prompt surge: +10% of the level per interval while one
    interval's sum varies by ~4% (no single step clears the step rule's 4 sigma): the
    fitted slope over the last intervals is believed by the ramp's fourth interval;
    flat noise is not a ramp."""
    rng = np.random.default_rng(3)
    flat, false_rises = Forecast(), 0
    for i in range(200):
        tokens = 7e5 * (1 + 0.04 * rng.standard_normal())
        flat = flat.observe(5.0 * (i + 1), 5.0, (600.0, tokens, 3e5), CFG)
        false_rises += flat.prompt_rate.slope > 0
    assert false_rises <= 4, false_rises
    f, seen = flat, None
    for k in range(1, 9):
        tokens = 7e5 * (1 + 0.10 * k) * (1 + 0.04 * rng.standard_normal())
        f = f.observe(5.0 * (200 + k), 5.0, (600.0, tokens, 3e5), CFG)
        if seen is None and f.prompt_rate.slope > 0:
            seen = k
            ahead = f.prompt_demand_at(40.0, CFG) / (f.prompt_rate.level or 1.0)
    assert seen is not None and seen <= 4, seen
    assert ahead > 1.3  # 40 s ahead at ~+10% per 5 s (less the fit's noise)


def test_daily_seasonality_anticipates_the_morning_ramp() -> None:
    day = 86_400.0

    def rate(t: float) -> float:  # a smooth day: 100 at night, 500 at noon
        return 300 - 200 * math.cos(2 * math.pi * t / day)

    interval = 600.0
    s = Series()
    t = interval
    while t < 2 * day:
        s = s.observe(t, rate(t - interval / 2), interval, CFG, count=1e9)
        t += interval
    # the second morning: the trend alone sees the last rise; the season knows the next hour
    now = 2 * day + 6 * 3600.0
    s = s.observe(now, rate(now - interval / 2), interval, CFG, count=1e9)
    ahead = s.at(3600.0, CFG)
    assert ahead == pytest.approx(rate(now + 3600.0), rel=0.1)
    assert ahead > s.level


def test_output_demand_follows_requests_not_a_burst_of_generated_tokens() -> None:
    f = Forecast()
    for i in range(10):
        f = f.observe(10.0 * (i + 1), 10.0, (100.0, 1e5, 5e4), CFG)
    assert f.output_per_request == pytest.approx(500.0)
    f = f.observe(110.0, 10.0, (100.0, 1e5, 2e5), CFG)  # a drained backlog reaches decode
    assert f.output_demand_at(30.0, CFG) == pytest.approx(2e5)  # now, not extrapolated
    f = f.observe(120.0, 10.0, (100.0, 1e5, 5e4), CFG)
    assert f.output_demand_at(30.0, CFG) == pytest.approx(5e4, rel=0.15)  # barely moved


def test_state_round_trips_through_json() -> None:
    f = Forecast()
    for i in range(5):
        f = f.observe(10.0 * (i + 1), 10.0, (100.0 + 20 * i, 1e5, 5e4), CFG)
    again = Forecast.from_dict(json.loads(json.dumps(f.to_dict())))
    assert again == f
    assert (
        Forecast.from_dict({"request_rate": {"season": [float("nan")]}}).request_rate.season == ()
    )
    assert Forecast.from_dict("garbage") == Forecast()


def test_a_slow_ramp_is_seen_while_it_lasts_and_a_step_in_the_long_window_is_not() -> None:
    """A compressed morning (planner/sim/scenarios.py weekly_holiday): +3% per 5 s interval
    while one interval's count varies by ~1.6% (Poisson, ~4,000 requests). When a
    fitted slope also needed its last step to rise by a standard deviation on its own,
    it was believed on 6-13 of 20 intervals (seeds 5-7): between beliefs the planner scaled
    down to the level, queued, and scaled up again a start-up late, every ~60 s of the
    morning. The 8-interval fit sees it on most intervals; a level shift inside that
    window is still a step (scaled for its level), not a ramp."""
    rng = np.random.default_rng(5)
    s, seen = Series(), []
    for i in range(40):
        rate = 800.0 * 1.03 ** max(0, i - 10)
        v = rng.poisson(rate * 5) / 5
        s = s.observe(5.0 * (i + 1), v, 5.0, CFG, count=v * 5)
        if i >= 20:
            seen.append(s.slope > 0)
    # the old rule: 13 of 20 on this seed (6 on seed 6); now 20 (19-20 on seeds 5-7)
    assert sum(seen) >= 16, seen
    shifted = Series()
    for i, level in enumerate([500.0] * 12 + [800.0] * 6):
        v = rng.poisson(level * 5) / 5
        shifted = shifted.observe(5.0 * (i + 1), v, 5.0, CFG, count=v * 5)
    assert shifted.slope == 0.0  # a step 4-6 intervals back is not extrapolated


def test_a_collapse_is_a_fall_below_a_quarter_within_one_interval() -> None:
    """An outage (1000 -> 600 -> 150 req/s) is flagged on the interval it falls below a
    quarter of its base; a 10x fall within a minute (linear, 5 s intervals) never is, nor
    is Poisson noise at a low rate."""
    s = feed([1000.0] * 8 + [600.0, 150.0], interval=5.0)
    assert s.collapsed
    assert not feed([1000.0] * 8 + [600.0], interval=5.0).collapsed
    linear = [1000.0 - 75.0 * k for k in range(1, 13)]  # down to 100 in 60 s
    flags = [feed([1000.0] * 8 + linear[:k], interval=5.0).collapsed for k in range(1, 13)]
    assert not any(flags)
    rng = np.random.default_rng(2)
    s, seen = Series(), 0
    for i in range(300):
        v = rng.poisson(2 * 5) / 5  # 2 req/s counted over 5 s
        s = s.observe(5.0 * (i + 1), v, 5.0, CFG, count=v * 5)
        seen += s.collapsed
    assert seen == 0
