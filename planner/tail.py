"""How far below an SLO target the planner's mean latency must stay for a given attainment.

The load model (``model.py``) predicts *mean* TTFT and decode step time; the SLO holds
for a share of requests (``spec.slo.targetAttainment``: 0.9 is "p90 within the
target", 0.99 "p99 within"). So each mean gets a budget: the target times a headroom,
and the headroom shrinks as the percentile rises, by the shape of each latency's tail:

- TTFT is the response time of the prefill queue, modelled as M/M/1, whose response
  time is exponential: its q-quantile is ``mean * ln(1 / (1 - q))`` (p90: 2.30 x the
  mean, p99: 4.61 x).
- TPOT is a mean over a request's tokens, so its spread across requests is narrow;
  modelled as normal with a coefficient of variation ``cv``: the q-quantile is
  ``mean * (1 + cv * z_q)``.

``PlannerConfig``'s ``ttft_headroom`` / ``tpot_headroom`` are the shares at the
reference p90 (the value the presets and the recorded simulator runs were sized with),
so the default target plans exactly as before, and another target scales them by the
ratio of the two quantile factors.
"""

from __future__ import annotations

import math
from statistics import NormalDist

REFERENCE_ATTAINMENT = 0.9  # the percentile the configured headrooms stand for
MAX_ATTAINMENT = 0.999  # 1.0 (allowed by the CRD) means "all": sized as p99.9
TPOT_CV = 0.15  # spread of per-request TPOT over its mean (a mean over many steps)


def _clamp(q: float) -> float:
    return min(MAX_ATTAINMENT, q)


def exponential_factor(q: float) -> float:
    """q-quantile over the mean of an exponential distribution."""
    return math.log(1.0 / (1.0 - _clamp(q)))


def normal_factor(q: float, cv: float = TPOT_CV) -> float:
    """q-quantile over the mean of a normal distribution with this cv."""
    return 1.0 + cv * NormalDist().inv_cdf(_clamp(q))


def ttft_scale(q: float) -> float:
    """Multiplier of the TTFT headroom for attainment ``q`` (1 at the reference p90)."""
    return exponential_factor(REFERENCE_ATTAINMENT) / exponential_factor(q)


def tpot_scale(q: float) -> float:
    """Multiplier of the TPOT headroom for attainment ``q`` (1 at the reference p90)."""
    return normal_factor(REFERENCE_ATTAINMENT) / normal_factor(q)
