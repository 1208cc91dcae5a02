"""Short-horizon load forecast: last level + damped trend, and daily seasonality.

Three series are forecast the same way: the request rate and the prompt and
output token rates (so a change of prompt length is forecast, not only a change
of rate). Each interval's observation is the *mean* over the interval, which lags
the rate at its end by half an interval; the trend term makes up for that too::

    forecast(h) = level + max(slope * (h + interval / 2),  season[t + h] - season[t])
                  clamped to [level / max_growth, level * max_growth]

``slope`` follows a rise at once and a fall with smoothing; a young rise (fewer
than ``trend_after`` rising intervals) grows the forecast at most ``young_growth``,
an older one up to ``max_growth``: a step in the load shows as one or two rising
intervals, a ramp keeps rising, so a step is scaled for its level rather than for a
trend it does not have. A change within the tolerance is noise and counts as
flat. ``season`` holds an EWMA of the level per bin of ``season_s`` (default one
day); a bin is used only once it has been seen, so the seasonal term starts
working on the second day. Plain numpy-free arithmetic: the state is
a handful of floats, carried in ``PlannerState`` and JSON-safe.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pdserve.planner import recurrence
from pdserve.planner.recurrence import Recurrence

UNSEEN = -1.0  # a seasonal bin with no observation yet (JSON has no NaN)
BASE_ALPHA = 0.5
BASE_SIGMA = math.sqrt(1 + BASE_ALPHA / (2 - BASE_ALPHA))  # std of (value - base) / sigma
LAST_SIGMA = math.sqrt(2.0)  # std of (value - last value) / sigma
SECOND_SIGMA = math.sqrt(6.0)  # std of (v - 2 v1 + v2) / sigma
RECENT = 8  # values kept for the fitted slope (a sustained ramp within the per-step noise)
# the fitted slope's windows, in intervals: the short one sees a fast ramp soon, the long
# one a slow ramp (a rise per interval below the interval's noise) at all: the standard
# error of a fitted slope falls as n^1.5, four more intervals give it ~4.6x the power
FIT_WINDOWS = (4, 8)
# a value below this share of its base, beyond the noise, within one interval is a collapse
# (an upstream outage, a partition): demand falling, even 10x within a minute, reaches half
# its lagging base on its last interval, not a quarter; a collapsed load tends to come back
# at once, its clients' retries on top (plan.py holds the pools for a scale-down window)
COLLAPSE = 0.25
# a scale-down waits while the fitted slope of the last RECENT values is this many standard
# errors above zero: too weak to forecast a ramp by (noise_z), strong enough not to bet
# against (a flat load passes it one interval in six)
UPTREND_Z = 1.0


@dataclass(frozen=True)
class ForecastConfig:
    tolerance: float = 0.1  # relative change treated as noise ...
    noise_z: float = 4.0  # ... or this many standard deviations of the change (see observe)
    fall_smoothing: float = 0.5  # EWMA weight of a new slope when the load falls
    max_growth: float = 4.0  # forecast at most x4 / at least /4 of the level
    season_s: float = 86_400.0
    season_bins: int = 48
    season_alpha: float = 0.5  # EWMA weight of a new level in its seasonal bin
    # a rise younger than this many intervals may be a step (one rising interval, or
    # two when it falls inside one: never three): its trend grows the forecast at most
    # young_growth; an older one's up to max_growth (the seasonal term is not capped)
    trend_after: int = 3
    young_growth: float = 1.5


@dataclass(frozen=True)
class Series:
    level: float | None = None  # last interval's mean
    slope: float = 0.0  # per second
    time_s: float | None = None  # end of the last interval
    interval_s: float = 0.0
    season: tuple[float, ...] = ()
    noise: float = 0.0  # dispersion: typical deviation from ``base`` over the Poisson one
    base: float = 0.0  # EWMA of the values: what a change is measured against
    rising: bool = False  # the last interval rose beyond the noise
    recent: tuple[float, ...] = ()  # the last RECENT values, oldest first
    rises: int = 0  # consecutive intervals that rose (a ramp's age, in intervals)
    collapsed: bool = False  # this interval fell below COLLAPSE of its base (beyond noise)
    uptrend: bool = False  # the last RECENT values' fitted slope is UPTREND_Z s.e. above 0
    recurrence: Recurrence = field(default_factory=Recurrence)  # a period found in the load

    def observe(
        self,
        t: float,
        value: float,
        interval_s: float,
        cfg: ForecastConfig,
        count: float,
        confirm: bool = False,
    ) -> Series:
        """``count``: requests behind this interval's value (sets the noise threshold);
        ``confirm``: a rise counts only on its second interval (token sums: heavy tails)."""
        season = _season_update(self.season, t, value, cfg)
        rec = self.recurrence.observe(t, value)
        if self.level is None or self.time_s is None or t <= self.time_s:
            return Series(
                value, 0.0, t, interval_s, season, 0.0, value, recent=(value,), recurrence=rec
            )
        base = self.base if self.base > 0 else self.level
        raw = (value - self.level) / (t - self.time_s)
        # A Poisson count's relative std is 1/sqrt(count); a token sum varies more (the
        # length mix): ``noise`` learns that dispersion factor (>= 1) while the load is flat.
        sigma = max(1.0, self.noise) / math.sqrt(max(count, 1.0))
        rel_base = (value - base) / max(base, 1e-9)
        rel_last = (value - self.level) / max(self.level, 1e-9)
        collapsed = value < COLLAPSE * base and -rel_base > cfg.noise_z * BASE_SIGMA * sigma
        step_rise = (
            rel_base > max(cfg.tolerance, cfg.noise_z * BASE_SIGMA * sigma)
            and rel_last > 2 * LAST_SIGMA * sigma
        )
        recent = (*self.recent, value)[-RECENT:]
        fit = _sustained_slope(recent, t - self.time_s, sigma * base, cfg, 2 if confirm else 1)
        # learn from every interval, an outlier capped (a real step must not teach it much)
        # in Poisson units; from the second difference once there are three values (zero
        # on a linear ramp, so a ramp is not learnt as noise), else from the base
        poisson = 1.0 / math.sqrt(max(count, 1.0))
        if len(self.recent) >= 2:
            second = (value - 2 * self.recent[-1] + self.recent[-2]) / max(base, 1e-9)
            dev, unit = abs(second), SECOND_SIGMA
        else:
            dev, unit = abs(rel_base), BASE_SIGMA
        z = min(dev / poisson, 1.5 * cfg.noise_z * unit * max(self.noise, 1.0)) / unit
        noise = math.sqrt(0.8 * max(self.noise, 1.0) ** 2 + 0.2 * z**2)
        if raw > 0 and (not step_rise or (confirm and not self.rising)):
            raw = 0.0
        raw = max(raw, fit)  # a ramp each of whose steps hides in the noise
        rising = step_rise  # confirms a token sum's jump: a fitted ramp does not
        if raw >= self.slope:
            slope = raw  # a rise is believed at once: waiting costs a pod start-up
        else:
            slope = (1 - cfg.fall_smoothing) * self.slope + cfg.fall_smoothing * raw
        if raw <= 0 < slope:
            slope = 0.0  # the rise has stopped: do not keep extrapolating it
        base = (1 - BASE_ALPHA) * base + BASE_ALPHA * value
        rises = self.rises + 1 if raw > 0 else 0
        uptrend = _fitted_z(recent, sigma * base) > UPTREND_Z
        return Series(
            value,
            slope,
            t,
            interval_s,
            season,
            noise,
            base,
            rising,
            recent,
            rises,
            collapsed,
            uptrend,
            rec,
        )

    def at(self, horizon_s: float, cfg: ForecastConfig) -> float:
        """Forecast of the value ``horizon_s`` after the last observation."""
        if self.level is None or self.time_s is None:
            return 0.0
        level = self.level
        trend = self.slope * (horizon_s + self.interval_s / 2)
        if self.slope > 0 and self.rises < cfg.trend_after:  # young: may be a step
            trend = min(trend, level * (cfg.young_growth - 1.0))  # (the season is not)
        daily = _season_delta(self.season, self.time_s, horizon_s, cfg)
        recurring = self.recurrence.delta(self.time_s, horizon_s)
        value = level + max(d for d in (trend, daily, recurring) if d is not None)
        return max(level / cfg.max_growth, min(level * cfg.max_growth, value), 0.0)

    def peak(self, horizon_s: float, cfg: ForecastConfig, steps: int = 8) -> float:
        """Largest forecast over [0, horizon_s]."""
        return max(self.at(horizon_s * i / steps, cfg) for i in range(steps + 1))


@dataclass(frozen=True)
class Forecast:
    request_rate: Series = field(default_factory=Series)
    prompt_rate: Series = field(default_factory=Series)
    output_rate: Series = field(default_factory=Series)  # generated tokens/s (lags demand)
    # output tokens per request, learnt while the load is flat (generated / arrived is
    # biased while it changes); output demand = request rate x this
    output_per_request: float = 0.0

    def observe(
        self, t: float, interval_s: float, values: tuple[float, float, float], cfg: ForecastConfig
    ) -> Forecast:
        r, p, o = values
        n = r * interval_s
        rate = self.request_rate.observe(t, r, interval_s, cfg, n)
        per_request = self.output_per_request
        if r > 0 and rate.slope == 0 and self.request_rate.slope == 0:
            # slow, and an outlier (a drained backlog reaching decode) capped at 2x
            sample = o / r if per_request <= 0 else min(o / r, 2 * per_request)
            per_request = sample if per_request <= 0 else 0.9 * per_request + 0.1 * sample
        return Forecast(
            rate,
            self.prompt_rate.observe(t, p, interval_s, cfg, n, confirm=True),
            self.output_rate.observe(t, o, interval_s, cfg, n, confirm=True),
            per_request,
        )

    def output_demand_at(self, horizon_s: float, cfg: ForecastConfig) -> float:
        """Output tokens/s to serve ``horizon_s`` ahead: the forecast request rate times the
        learnt tokens per request. Generated tokens are not extrapolated: they come in
        bursts when a prefill backlog reaches decode, and that is not demand growth."""
        if self.output_per_request <= 0:
            return self.output_rate.at(horizon_s, cfg)
        by_rate = self.request_rate.at(horizon_s, cfg) * self.output_per_request
        return max(self.output_rate.level or 0.0, by_rate)

    def prompt_demand_at(self, horizon_s: float, cfg: ForecastConfig) -> float:
        """Prompt tokens/s ``horizon_s`` ahead: the prompt-token forecast, or the request
        forecast at today's tokens per request if that is higher (a rise in requests shows
        with less noise than a rise in tokens)."""
        level, tokens = self.request_rate.level, self.prompt_rate.level
        by_rate = self.request_rate.at(horizon_s, cfg) * tokens / level if level and tokens else 0.0
        return max(self.prompt_rate.at(horizon_s, cfg), by_rate)

    def prompt_peak(self, horizon_s: float, cfg: ForecastConfig, steps: int = 8) -> float:
        return max(self.prompt_demand_at(horizon_s * i / steps, cfg) for i in range(steps + 1))

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {k: _series_dict(getattr(self, k)) for k in SERIES}
        body["output_per_request"] = self.output_per_request
        return body

    @classmethod
    def from_dict(cls, body: Any) -> Forecast:
        if not isinstance(body, dict):
            return cls()
        per_request = float(body.get("output_per_request", 0.0))
        rate, prompt, output = (_series(body.get(k)) for k in SERIES)
        return cls(rate, prompt, output, per_request)


SERIES = ("request_rate", "prompt_rate", "output_rate")


def _sustained_slope(
    values: tuple[float, ...], step_s: float, sigma: float, cfg: ForecastConfig, last: int = 1
) -> float:
    """Least-squares slope (per second) of the last values, equally spaced ``step_s``
    apart (each value's noise ``sigma``), the steepest over the windows of FIT_WINDOWS
    that show a ramp that goes on, else 0. A window shows one when its slope is
    ``noise_z`` standard errors above zero, a line explains it better than a level shift
    (two flat levels, the best split: a step is scaled for its level, not extrapolated;
    the shift has one parameter more, so it must win by 2 sigma^2, as in AIC), and the
    last ``last`` steps (token sums: two, heavy tails) are not more than two standard
    deviations below the fitted step (the ramp stopped). A ramp of 15% per interval under
    5% noise per value is seen on its third interval although no single step stands out;
    one of 3% under 1.6% noise (a compressed morning) by the long window, while it lasts:
    it was seen on 6-13 intervals of 20 when its last step had to rise by a standard
    deviation on its own (test_a_slow_ramp_is_seen_while_it_lasts...)."""
    best = 0.0
    for n in FIT_WINDOWS:
        if len(values) < n or step_s <= 0:
            continue
        window = values[-n:]
        xs = [i - (n - 1) / 2 for i in range(n)]
        sxx = sum(x * x for x in xs)
        mean = sum(window) / n
        slope = sum(x * v for x, v in zip(xs, window, strict=True)) / sxx
        if slope <= 0 or slope < cfg.noise_z * sigma / math.sqrt(sxx):
            continue
        line = sum((v - mean - slope * x) ** 2 for x, v in zip(xs, window, strict=True))
        if _level_shift_rss(window) + 2 * sigma**2 < line:
            continue
        steps = [b - a for a, b in itertools.pairwise(window)][-last:]
        if min(steps) < slope - 2 * LAST_SIGMA * sigma:
            continue
        best = max(best, slope / step_s)
    return best


def _fitted_z(values: tuple[float, ...], sigma: float) -> float:
    """The least-squares slope of all ``values`` in standard errors (each value's noise
    ``sigma``); 0 with fewer than four values."""
    n = len(values)
    if n < 4 or sigma <= 0:
        return 0.0
    xs = [i - (n - 1) / 2 for i in range(n)]
    sxx = sum(x * x for x in xs)
    slope = sum(x * v for x, v in zip(xs, values, strict=True)) / sxx
    return slope * math.sqrt(sxx) / sigma


def _level_shift_rss(values: tuple[float, ...]) -> float:
    """Residual sum of squares of the best fit by two flat levels (one split)."""
    best = math.inf
    for k in range(1, len(values)):
        rss = 0.0
        for part in (values[:k], values[k:]):
            m = sum(part) / len(part)
            rss += sum((v - m) ** 2 for v in part)
        best = min(best, rss)
    return best


def _bin(t: float, cfg: ForecastConfig) -> int:
    return int((t % cfg.season_s) / cfg.season_s * cfg.season_bins) % cfg.season_bins


def _season_update(season: tuple[float, ...], t: float, value: float, cfg: ForecastConfig):  # type: ignore[no-untyped-def]
    bins = list(season) if len(season) == cfg.season_bins else [UNSEEN] * cfg.season_bins
    i = _bin(t, cfg)
    old = bins[i]
    bins[i] = value if old == UNSEEN else (1 - cfg.season_alpha) * old + cfg.season_alpha * value
    return tuple(bins)


def _season_delta(
    season: tuple[float, ...], t: float, horizon_s: float, cfg: ForecastConfig
) -> float | None:
    if len(season) != cfg.season_bins:
        return None
    now, then = season[_bin(t, cfg)], season[_bin(t + horizon_s, cfg)]
    if now == UNSEEN or then == UNSEEN:
        return None
    return then - now


def _series_dict(s: Series) -> dict[str, Any]:
    """Every field (a new one included), as JSON: the tuples as lists, the recurrence as
    its own dict."""
    out = {f.name: getattr(s, f.name) for f in fields(s)}
    out.update(season=list(s.season), recent=list(s.recent))
    out["recurrence"] = recurrence.to_dict(s.recurrence)
    return out


def _series(body: Any) -> Series:
    if not isinstance(body, dict):
        return Series()
    level, t = body.get("level"), body.get("time_s")
    season = tuple(float(x) for x in body.get("season", ()))
    if not all(math.isfinite(x) for x in season):
        season = ()
    return replace(
        Series(),
        level=None if level is None else float(level),
        slope=float(body.get("slope", 0.0)),
        time_s=None if t is None else float(t),
        interval_s=float(body.get("interval_s", 0.0)),
        season=season,
        noise=float(body.get("noise", 0.0)),
        base=float(body.get("base", 0.0)),
        rising=bool(body.get("rising", False)),
        recent=tuple(float(x) for x in body.get("recent", ()))[-RECENT:],
        rises=int(body.get("rises", 0)),
        collapsed=bool(body.get("collapsed", False)),
        uptrend=bool(body.get("uptrend", False)),
        recurrence=recurrence.from_dict(body.get("recurrence")),
    )
