"""Snapshots from a Prometheus server's HTTP API (instant queries over a window).

Each metric is fetched as its ``increase`` over the window (counters and
histogram buckets) or its current sum (gauges); the results form a synthetic
scrape whose difference from an empty scrape ``window_s`` earlier is exactly
that increase, so the same code as for /metrics text builds the snapshot. Every
query of one snapshot is evaluated at the snapshot's instant (the API's ``time``):
queried one after the other at the server's "now", a scrape landing between two
of them moved one counter's increase (its extrapolation) and not the other's.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx

from pdserve.planner import metrics as m
from pdserve.planner.config import SLO
from pdserve.planner.metrics import Labels, MetricsError, Scrape
from pdserve.planner.snapshot import MetricsSnapshot, PoolStatus

COUNTERS = (m.ROUTER_REQUESTS, m.ROUTER_PROMPT_TOKENS, m.ROUTER_OUTPUT_TOKENS)
ROLE_COUNTERS = (m.CACHE_HITS,)
HISTOGRAMS = (m.ROUTER_TTFT, m.ROUTER_TPOT, m.ROUTER_ITL, m.QUEUE_WAIT)
GAUGES = (m.ROUTER_PREFILL_QUEUE,)
ROLE_GAUGES = (m.RUNNING, m.WAITING, m.KV_TOTAL, m.KV_FREE, m.ROUTER_INFLIGHT)


class PrometheusAPI:
    """Reads the planner's inputs from ``url`` (e.g. http://prometheus:9090).

    ``selector`` is extra label matchers for every series, e.g.
    ``namespace="prod",service="chat"``.
    """

    def __init__(
        self,
        url: str,
        *,
        selector: str = "",
        window_s: float = 60.0,
        client: httpx.Client | None = None,
        timeout_s: float = 5.0,
        quiet: bool = False,
    ) -> None:
        # quiet: no word of what the server sent goes into an error (the operator's status
        # and Events, for a URL an LLMService author chose: an SSRF would read it there).
        self.quiet = quiet
        if not url.startswith(("http://", "https://")):
            raise MetricsError(f"Prometheus URL must start with http:// or https://, got {url!r}")
        if window_s <= 0:
            raise MetricsError(f"window_s must be > 0, got {window_s}")
        self.url = url.rstrip("/")
        self.selector = selector
        self.window_s = window_s
        self._client = client or httpx.Client(timeout=timeout_s)

    def query(self, promql: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """One instant query (at ``at``, Unix seconds; the server's now if None); returns
        (labels, value) rows of the vector result."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        try:
            reply = self._client.get(f"{self.url}/api/v1/query", params=params)
        except httpx.HTTPError as exc:
            detail = type(exc).__name__ if self.quiet else str(exc)
            raise MetricsError(f"Prometheus query failed ({promql}): {detail}") from None
        try:
            body = reply.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("status") != "success":
            said = "" if self.quiet or not isinstance(body, dict) else f": {body.get('error')}"
            raise MetricsError(
                f"Prometheus query {promql!r} failed: HTTP "
                f"{reply.status_code}, not a successful reply{said}"
            )
        return _vector(body, promql)

    def scrape(self, now_s: float) -> Scrape:
        samples: dict[str, list[tuple[Labels, float]]] = {}
        w = f"[{int(self.window_s)}s]"
        put = functools.partial(self._put, samples, at=now_s)
        for name in COUNTERS:
            put(name, f"sum(increase({self._sel(name)}{w}))")
        for name in ROLE_COUNTERS:
            put(name, f"sum by (role) (increase({self._sel(name)}{w}))")
        for name in HISTOGRAMS:
            put(name + "_bucket", f"sum by (le) (increase({self._sel(name + '_bucket')}{w}))")
            for part in ("_count", "_sum"):
                put(name + part, f"sum(increase({self._sel(name + part)}{w}))")
        for name in GAUGES:
            put(name, f"sum({self._sel(name)})")
        for name in ROLE_GAUGES:
            put(name, f"sum by (role) ({self._sel(name)})")
        return Scrape(now_s, samples)

    def snapshot(
        self, now_s: float, prefill: PoolStatus, decode: PoolStatus, slo: SLO
    ) -> MetricsSnapshot:
        before = Scrape(now_s - self.window_s, {})
        return m.snapshot_from_scrapes(before, self.scrape(now_s), prefill, decode, slo)

    def _sel(self, name: str) -> str:
        return f"{name}{{{self.selector}}}" if self.selector else name

    def _put(
        self, samples: dict[str, list[tuple[Labels, float]]], name: str, q: str, at: float
    ) -> None:
        rows = self.query(q, at)
        if rows:
            samples[name] = [(tuple(sorted(labels.items())), v) for labels, v in rows]


def _vector(body: dict[str, Any], promql: str) -> list[tuple[dict[str, str], float]]:
    data = body.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise MetricsError(f"Prometheus query {promql!r}: expected a vector result")
    rows = []
    for item in data.get("result", []):
        try:
            labels = {str(k): str(v) for k, v in item.get("metric", {}).items()}
            rows.append((labels, float(item["value"][1])))
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise MetricsError(
                f"Prometheus query {promql!r}: a sample is not {{metric, value: [time, number]}}"
            ) from None
    return [(labels, v) for labels, v in rows if v == v]  # drop NaN (empty rate windows)
