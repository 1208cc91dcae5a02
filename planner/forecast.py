"""Short-horizon load forecast: last level + damped trend, and daily seasonality.

Three series are forecast the same way: the request rate and the prompt and
output token rates (so a change of prompt length is forecast, not only a change
of rate). Each interval's observation is the *mean* over the interval, which lags
the rate at its end by half an interval; the trend term makes up for that too::

    forecast(h) = level + max(slope * (h + interval / 2),  season[t + h] - season[t])
                  clamped to [level / max_growth, level * max_growth]

``slope`` follows a rise at once (a burst is scaled for one interval after it
starts) and a fall with smoothing; a change within the tolerance is noise and
counts as flat. ``season`` holds an EWMA of the level per bin of ``season_s``
(default one day); a bin is used only once it has been seen, so the seasonal
term starts working on the second day. Plain numpy-free arithmetic: the state is
a handful of floats, carried in ``PlannerState`` and JSON-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

TOKEN_NOISE = 1.5  # relative noise of a token sum over that of the request count
UNSEEN = -1.0  # a seasonal bin with no observation yet (JSON has no NaN)


@dataclass(frozen=True)
class ForecastConfig:
    tolerance: float = 0.1  # relative change treated as noise ...
    noise_z: float = 4.0  # ... or this many Poisson standard deviations of the interval's count
    fall_smoothing: float = 0.5  # EWMA weight of a new slope when the load falls
    max_growth: float = 4.0  # forecast at most x4 / at least /4 of the level
    season_s: float = 86_400.0
    season_bins: int = 48
    season_alpha: float = 0.5  # EWMA weight of a new level in its seasonal bin


@dataclass(frozen=True)
class Series:
    level: float | None = None  # last interval's mean
    slope: float = 0.0  # per second
    time_s: float | None = None  # end of the last interval
    interval_s: float = 0.0
    season: tuple[float, ...] = ()

    def observe(
        self, t: float, value: float, interval_s: float, cfg: ForecastConfig, count: float
    ) -> Series:
        """``count``: requests behind this interval's value (sets the noise threshold)."""
        season = _season_update(self.season, t, value, cfg)
        if self.level is None or self.time_s is None or t <= self.time_s:
            return Series(value, 0.0, t, interval_s, season)
        raw = (value - self.level) / (t - self.time_s)
        noise = max(cfg.tolerance, cfg.noise_z / math.sqrt(max(count, 1.0)))
        if abs(value - self.level) <= noise * max(self.level, 1e-9):
            raw = 0.0
        if raw >= self.slope:
            slope = raw  # a rise is believed at once: waiting costs a pod start-up
        else:
            slope = (1 - cfg.fall_smoothing) * self.slope + cfg.fall_smoothing * raw
        if raw <= 0 < slope:
            slope = 0.0  # the rise has stopped: do not keep extrapolating it
        return Series(value, slope, t, interval_s, season)

    def at(self, horizon_s: float, cfg: ForecastConfig) -> float:
        """Forecast of the value ``horizon_s`` after the last observation."""
        if self.level is None or self.time_s is None:
            return 0.0
        level = self.level
        trend = self.slope * (horizon_s + self.interval_s / 2)
        seasonal = _season_delta(self.season, self.time_s, horizon_s, cfg)
        value = level + (trend if seasonal is None else max(trend, seasonal))
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
            per_request = o / r if per_request <= 0 else 0.7 * per_request + 0.3 * o / r
        return Forecast(
            rate,
            # a sum of lognormal lengths is noisier than a count: fewer effective samples
            self.prompt_rate.observe(t, p, interval_s, cfg, n / TOKEN_NOISE**2),
            self.output_rate.observe(t, o, interval_s, cfg, n / TOKEN_NOISE**2),
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

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {k: _series_dict(getattr(self, k)) for k in SERIES}
        body["output_per_request"] = self.output_per_request
        return body

    @classmethod
    def from_dict(cls, body: Any) -> Forecast:
        if not isinstance(body, dict):
            return cls()
        per_request = float(body.get("output_per_request", 0.0))
        return cls(*(_series(body.get(k)) for k in SERIES), per_request)


SERIES = ("request_rate", "prompt_rate", "output_rate")


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
    return {
        "level": s.level,
        "slope": s.slope,
        "time_s": s.time_s,
        "interval_s": s.interval_s,
        "season": list(s.season),
    }


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
    )
