"""Traces, request mixes and cost models for simulate.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pdserve.planner.capacity import DecodeProfile, PrefillProfile, Profile, load_profile
from pdserve.planner.presets import PRESETS
from pdserve.planner.sim.cluster import CostModel


@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    load: Callable[[float], float]  # request rate as a fraction of the reference peak
    long_share: Callable[[float], float]  # fraction of requests with long prompts


def scenarios(scale_s: float) -> list[Scenario]:
    """The three traces; ``scale_s`` stretches time (1.0 = full length)."""
    day = 7200.0 * scale_s  # one day compressed into two hours: steeper ramps than real

    def diurnal(t: float) -> float:
        return 0.15 + 0.85 * (0.5 - 0.5 * math.cos(2 * math.pi * t / day))

    b0, b1 = 900.0 * scale_s, 1500.0 * scale_s  # burst: 10x within one minute, held 10 min

    def burst(t: float) -> float:
        return 0.1 * (1 + 9 * _ramp(t, b0, 60.0) - 9 * _ramp(t, b1, 60.0))

    s0, s1 = 600.0 * scale_s, 1200.0 * scale_s  # long-prompt surge: 30% of prompts ~8k tokens

    def surge(t: float) -> float:
        return 0.3 * (_ramp(t, s0, 60.0) - _ramp(t, s1, 60.0))

    return [
        Scenario("diurnal", day, diurnal, lambda t: 0.0),
        Scenario("burst", 2400.0 * scale_s, burst, lambda t: 0.0),
        Scenario("long_prompt_surge", 1800.0 * scale_s, lambda t: 0.35, surge),
    ]


def formerly_heldout_scenarios(scale_s: float) -> list[Scenario]:
    """Traces that were held out once and have since been looked at to change the planner:
    still scored, apart from both the tuning minimum and ``attainment_heldout``
    (``attainment_formerly_heldout``, the worst of them), so that nothing is hidden.

    ``weekly_holiday`` was looked at for the forecast's slow-ramp change, ``growth_outage``
    (below) for the change after it (its retry surge and its evenings' mix shift), and
    ``tenant_waves`` (below) for the recurring-pattern change after that.

    ``weekly_holiday``: seven compressed days of 20 minutes (not the forecast's season, and
    a different shape: a sharper morning rise, a slower evening fall), weekdays at full
    height, the weekend at 60%, day 4 a holiday at 35%; and on day 2, in the quiet early
    hours, a flash crowd: from 0.12 of the peak to 0.82 within 30 s (7x), held 2 minutes
    while the morning rises under it, gone within 1 minute (a link on a front page)."""
    day = 1200.0 * scale_s
    height = (1.0, 1.0, 1.0, 0.35, 1.0, 0.6, 0.6)  # Monday .. Sunday, Thursday a holiday
    f0, held, fall = day, 120.0 * scale_s, 60.0 * scale_s  # day 2 at midnight

    def daily(phase: float) -> float:
        rise = min(1.0, phase / 0.35)  # 0 -> 1 by ~08:24, then a long decline
        shape = rise**2 if phase < 0.35 else 1.0 - (phase - 0.35) / 0.65
        return 0.12 + 0.88 * shape

    def weekly(t: float) -> float:
        d = min(6, int(t // day))
        base = height[d] * daily((t % day) / day)
        crowd = _ramp(t, f0, 30.0) - _ramp(t, f0 + 30.0 + held, fall)
        return base + 0.7 * crowd

    return [
        Scenario("weekly_holiday", 7 * day, weekly, lambda t: 0.0),
        growth_outage(scale_s),
        tenant_waves(scale_s),
    ]


def heldout_scenarios(scale_s: float) -> list[Scenario]:
    """Traces that neither the planner's forecast nor its knobs were tuned on, scored apart
    as ``attainment_heldout`` (the worst of them): ``launch_decay`` (below), defined and
    committed before any run on it, when ``tenant_waves`` became a tuning trace."""
    return [launch_decay(scale_s)]


def launch_decay(scale_s: float) -> Scenario:
    """The fourth held-out trace, written down (and committed) before any run on it and
    before the planner was changed by looking at ``tenant_waves``: a shape unlike every other.

    80 minutes of a product launch. The organic load grows slowly from 0.22 to 0.30 of the
    reference peak over the first hour, then falls to 0.20 by the end (the evening). At
    minute 15 the launch is announced: new users add 0.70 of the peak within 20 s, and the
    excess decays with a half-life of 6 minutes towards the 15% of it that stays. At minute
    45 a reminder adds 0.45 within 40 s, decaying with a half-life of 4 minutes towards 10%
    of it. The new users paste documents: 15% of their requests are long (~8k tokens), so
    the prompt mix shifts with the excess and fades with it. Different from the other
    traces: steps up that do not hold (every other step holds, or ends as sharply as it
    began) but decay smoothly, so the load falls for many minutes right after a rise, and
    the two steps differ in height, edge and decay."""
    duration = 4800.0 * scale_s
    l1, e1, h1, half1, keep1 = 900.0 * scale_s, 20.0 * scale_s, 0.70, 360.0 * scale_s, 0.15
    l2, e2, h2, half2, keep2 = 2700.0 * scale_s, 40.0 * scale_s, 0.45, 240.0 * scale_s, 0.10

    def organic(t: float) -> float:
        hour = 3600.0 * scale_s
        if t < hour:
            return 0.22 + 0.08 * t / hour
        return 0.30 - 0.10 * (t - hour) / (duration - hour)

    def excess(
        t: float, start: float, edge: float, height: float, half: float, keep: float
    ) -> float:
        if t < start:
            return 0.0
        decay = 0.5 ** (max(0.0, t - start - edge) / half)
        return height * _ramp(t, start, edge) * (keep + (1.0 - keep) * decay)

    def new_users(t: float) -> float:
        return excess(t, l1, e1, h1, half1, keep1) + excess(t, l2, e2, h2, half2, keep2)

    def load(t: float) -> float:
        return organic(t) + new_users(t)

    def long_share(t: float) -> float:
        return 0.15 * new_users(t) / load(t)

    return Scenario("launch_decay", duration, load, long_share)


def tenant_waves(scale_s: float) -> Scenario:
    """The third held-out trace, written down (and committed) before any run on it, before
    the planner was changed by looking at ``growth_outage``: a shape unlike every other.
    Held out for that change (0.928 on seeds 0-2); a tuning trace since
    (``formerly_heldout_scenarios``).

    Two tenants share the pools for 100 minutes. The *interactive* tenant (the normal mix)
    rises slowly from 0.30 to 0.55 of the reference peak at mid-trace and back to 0.30 (a
    half-cosine: no day, no season). A *batch* tenant sends only long (~8k-token) prompts
    in waves every 12 minutes (an hourly cron, compressed), from minute 6: each wave starts
    within 5 s (jobs submitted at once; the client's concurrency then holds the rate
    steady), lasts 4 minutes and stops within 10 s; the waves' heights differ (0.04-0.12 of
    the peak's request rate), so the request rate and the prompt-token mix jump *together*
    (one wave at 0.12 over 0.45: the long share ~21%, prompt tokens ~2.5x), and a wave's
    end is a drop as sharp as its start. From minute 55 a *regional failover-in*: another
    region's traffic (interactive mix) is moved here gradually, +0.35 of the peak over 8
    minutes (weighted DNS shifting 5% at a time), held until minute 80, then sent back
    within 30 s. Different from the other traces: a step in rate and mix at once (the surge
    and the evenings shift the mix alone, the burst and the outage the rate alone), a
    period of 12 minutes that no season bins, a linear ramp slower than the burst's and
    faster than a morning's, and sharp falls while a wave is running."""
    duration = 6000.0 * scale_s
    period, w0, w_len = 720.0 * scale_s, 360.0 * scale_s, 240.0 * scale_s
    heights = (0.06, 0.10, 0.04, 0.12, 0.08, 0.10, 0.05, 0.12)
    r0, r_len, r_end = 3300.0 * scale_s, 480.0 * scale_s, 4800.0 * scale_s

    def interactive(t: float) -> float:
        base = 0.30 + 0.25 * (0.5 - 0.5 * math.cos(2 * math.pi * t / duration))
        return base + 0.35 * (_ramp(t, r0, r_len) - _ramp(t, r_end, 30.0 * scale_s))

    def batch(t: float) -> float:
        k = int((t - w0) // period) if t >= w0 else -1
        if not 0 <= k < len(heights):
            return 0.0
        start = w0 + k * period
        on = _ramp(t, start, 5.0 * scale_s) - _ramp(t, start + w_len, 10.0 * scale_s)
        return heights[k] * on

    def load(t: float) -> float:
        return interactive(t) + batch(t)

    def long_share(t: float) -> float:
        b = batch(t)
        return b / (interactive(t) + b) if b > 0 else 0.0

    return Scenario("tenant_waves", duration, load, long_share)


def growth_outage(scale_s: float) -> Scenario:
    """The second held-out trace, written down (and committed) before any run on it, after
    the planner had been changed by looking at ``weekly_holiday``: a different shape. Held
    out for that change; a tuning trace since (``formerly_heldout_scenarios``).

    Six compressed days of 15 minutes (neither 20 minutes nor the forecast's season), each
    with two peaks (late morning, 0.3 of the day, and a lower, wider evening one at 0.7:
    0.8 of the morning's height) over a 0.08 floor; the service grows, each day's height
    from 0.55 to 1.0 of the reference peak (+0.09 a day: yesterday's season is always too
    low); in the evening peak (0.62-0.78 of each day, 30 s edges) 10% of prompts are long
    (~8k tokens: a batch of document jobs; the prompt tokens ~1.7x at the same request
    rate). Day 3 (0-based), at 0.22 of the day, on the morning's rise: an upstream outage
    cuts the load to 0.03 of the peak within 10 s for 90 s, then the clients' retries
    come back at once (within 10 s) as 1.5x the day's normal load (at the morning peak:
    ~1.1 of the reference peak) for 1 minute, decaying linearly to normal over 2 minutes.
    Day 4, from 0.55 of the day to its end: a failover moves 40% of the traffic elsewhere
    within 20 s (a sudden drop), and day 5 is normal again (the season saw a low evening)."""
    day = 900.0 * scale_s
    n_days = 6
    o0 = 3 * day + 0.22 * day  # the outage
    o_cut, o_out, o_burst, o_decay = 10.0 * scale_s, 90.0 * scale_s, 60.0, 120.0
    o_burst, o_decay = o_burst * scale_s, o_decay * scale_s
    f0, f_edge = 4 * day + 0.55 * day, 20.0 * scale_s  # the failover
    edge = 30.0 * scale_s

    def bump(phase: float, centre: float, width: float) -> float:
        return math.exp(-0.5 * ((phase - centre) / width) ** 2)

    def normal(t: float) -> float:
        d = min(n_days - 1, int(t // day))
        phase = (t % day) / day
        height = 0.55 + 0.09 * d
        shape = max(bump(phase, 0.3, 0.1), 0.8 * bump(phase, 0.7, 0.12))
        load = 0.08 + (height - 0.08) * shape
        if d == 4:  # the failover: 40% of the traffic gone to the day's end
            load *= 1.0 - 0.4 * _ramp(t, f0, f_edge)
        return load

    def load(t: float) -> float:
        base = normal(t)
        back = o0 + o_cut + o_out  # the retries return
        if o0 <= t < back:
            return base + (0.03 - base) * _ramp(t, o0, o_cut)
        if back <= t < back + o_burst + o_decay:
            surge = 1.5 - 0.5 * _ramp(t, back + o_burst, o_decay)
            return 0.03 + (surge * base - 0.03) * _ramp(t, back, 10.0 * scale_s)
        return base

    def long_share(t: float) -> float:
        phase_s = t % day
        return 0.1 * (_ramp(phase_s, 0.62 * day, edge) - _ramp(phase_s, 0.78 * day, edge))

    return Scenario("growth_outage", n_days * day, load, long_share)


def _ramp(t: float, start: float, width: float) -> float:
    return min(1.0, max(0.0, (t - start) / width))


@dataclass(frozen=True)
class Mix:
    """Lognormal lengths (mean, sigma of log) clipped to [lo, hi]."""

    prompt: tuple[float, float, int, int] = (1000.0, 0.6, 32, 8192)
    long_prompt: tuple[float, float, int, int] = (8000.0, 0.4, 2048, 16384)
    output: tuple[float, float, int, int] = (500.0, 0.7, 2, 2048)

    def sample(
        self, rng: np.random.Generator, n: int, long_share: float
    ) -> tuple[np.ndarray, np.ndarray]:
        prompt = _lognormal(rng, n, *self.prompt)
        if long_share > 0:
            long = rng.random(n) < long_share
            prompt[long] = _lognormal(rng, int(long.sum()), *self.long_prompt)
        return prompt, _lognormal(rng, n, *self.output)


def _lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int):  # type: ignore[no-untyped-def]
    mu = math.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), lo, hi)


@dataclass(frozen=True)
class Setup:
    planner_profile: Profile  # what the planner believes
    cost: CostModel  # what the cluster does
    ttft_s: float
    tpot_s: float


def slower(profile: Profile, factor: float) -> Profile:
    """The same profile with every time coefficient multiplied by ``factor``."""
    p, d = profile.prefill, profile.decode
    return replace(
        profile,
        prefill=PrefillProfile(
            p.chunk_overhead_s * factor,
            p.tokens_per_s / factor,
            p.chunk_tokens,
            p.attention_s_per_token_sq * factor,
        ),
        decode=DecodeProfile(
            d.step_base_s * factor,
            d.step_per_seq_s * factor,
            d.step_per_kv_token_s * factor,
            d.max_num_seqs,
            d.kv_capacity_tokens,
        ),
    )


def setup(name: str, truth_factor: float) -> Setup:
    """``h100-llama3-8b`` | ``cpu-tiny`` | a profile JSON from ``pdserve profile``."""
    if name == "h100-llama3-8b":
        profile = PRESETS[name]
        # 128 KiB of KV per token; 400 Gb/s NIC (ConnectX-7 NDR) at ~80%; the pod start-up
        # is the profile's (40 s, its startup_source says how it was arrived at)
        cost = CostModel(
            slower(profile, truth_factor), 131_072, 40e9, 0.001, startup_of(profile, 40.0)
        )
        return Setup(profile, cost, ttft_s=2.0, tpot_s=0.05)
    profile = PRESETS["cpu-tiny"] if name == "cpu-tiny" else load_profile(name)
    # tiny model: 2 layers x 2 KV heads x 64 dims x fp32 K and V; loopback copy ~5 GB/s
    cost = CostModel(
        slower(profile, truth_factor), 2 * 2 * 2 * 64 * 4, 5e9, 0.0005, startup_of(profile, 10.0)
    )
    return Setup(profile, cost, ttft_s=3.0, tpot_s=0.2)


def startup_of(profile: Profile, default_s: float) -> float:
    """The pod start-up the simulated cluster uses: the profile's (measured by ``pdserve
    profile``, or stated with its source), else ``default_s`` (an assumption)."""
    return default_s if profile.startup_s is None else profile.startup_s
