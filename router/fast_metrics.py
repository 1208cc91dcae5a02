"""Counters, gauges and histograms for the router's per-request series, without locks.

prometheus_client's metrics take a lock and run several checks on every ``inc`` and
``observe``: with ~17 of them per P/D request they were ~6% of the router's CPU
(``bench/router_throughput.py --profile``). The router updates these series from its event
loop only, so a plain attribute is enough; prometheus_client still renders them, through
``collect`` (a custom collector: the same names, types, labels and buckets as its own
Counter, Gauge and Histogram, so scrapes, ``metrics_merge`` and dashboards see no change).
Series that are not per request stay prometheus_client's own (router/metrics.py).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

INF = float("inf")


class Value:
    """One counter or gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class Buckets:
    """One histogram series: per-bucket counts (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float, times: int = 1) -> None:
        """``times`` observations of ``amount`` (the tokens of one delta: router/metrics.py
        ``itl``)."""
        self.sum += amount * times
        self.counts[bisect_left(self.bounds, amount)] += times  # first bound >= amount (le)


class _Family:
    """A metric with its series by label values; without labels, itself one series."""

    def __init__(
        self,
        name: str,
        doc: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name, self.doc, self.labelnames = name, doc, tuple(labelnames)
        self._series: dict[tuple[str, ...], Any] = {}
        if not self.labelnames:
            self._one = self._series[()] = self._new()
        if registry is not None:
            registry.register(self)  # type: ignore[arg-type]

    def _new(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: Any, **named: Any) -> Any:
        """The series of these label values, by position or by name (as prometheus_client)."""
        if named and not values and set(named) == set(self.labelnames):
            values = tuple(named[n] for n in self.labelnames)
        elif named:
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {values} {named}")
        if len(values) != len(self.labelnames) or not self.labelnames:
            raise ValueError(f"{self.name}: labels {self.labelnames}, got {values}")
        key = tuple(str(v) for v in values)
        got = self._series.get(key)
        if got is None:
            got = self._series[key] = self._new()
        return got

    def describe(self) -> list[Metric]:
        return []  # the registry then reads names from collect (ours never collide)

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class _Values(_Family):
    """Series of one number each (a counter's or a gauge's)."""

    family: Any = None  # the prometheus_client family it renders as

    def _new(self) -> Value:
        return Value()

    def inc(self, amount: float = 1.0) -> None:
        self._one.inc(amount)

    def collect(self) -> Iterator[Metric]:
        fam = self.family(self.name, self.doc, labels=self.labelnames)
        for key, v in list(self._series.items()):
            fam.add_metric(key, v.value)
        yield fam


class Counter(_Values):
    family = CounterMetricFamily


class Gauge(_Values):
    family = GaugeMetricFamily

    def dec(self, amount: float = 1.0) -> None:
        self._one.dec(amount)

    def set(self, value: float) -> None:
        self._one.set(value)


class Histogram(_Family):
    def __init__(self, *args: Any, buckets: Sequence[float] = (), **kw: Any) -> None:
        """:class:`_Family`'s arguments, and the buckets' upper bounds (+Inf added)."""
        bounds = tuple(float(b) for b in buckets)
        if not bounds or bounds[-1] != INF:
            bounds += (INF,)
        self.bounds = bounds
        # counts made elsewhere (the compiled lane's, router/fast_lane.py), folded into the
        # unlabelled series on each scrape: () -> (per-bucket counts since the last call, sum)
        self.pull: Callable[[], tuple[Sequence[int], float]] | None = None
        super().__init__(*args, **kw)

    def _new(self) -> Buckets:
        return Buckets(self.bounds)

    def observe(self, amount: float, times: int = 1) -> None:
        self._one.observe(amount, times)

    def fold(self) -> None:
        """Take in what ``pull`` counted since the last fold."""
        if self.pull is None:
            return
        counts, total = self.pull()
        h = self._one
        for i, n in enumerate(counts):
            h.counts[i] += n
        h.sum += total

    def collect(self) -> Iterator[Metric]:
        self.fold()
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds]
        for key, h in list(self._series.items()):
            total, cumulative = 0, []
            for le, n in zip(les, list(h.counts), strict=True):
                total += n
                cumulative.append((le, total))
            fam.add_metric(list(key), cumulative, h.sum)
        yield fam
