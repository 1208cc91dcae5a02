"""The router's lock-free series (router/fast_metrics.py) render exactly as
prometheus_client's own Counter, Gauge and Histogram do after the same updates: a scrape,
the per-process merge and the dashboards cannot tell them apart."""

from __future__ import annotations

import random

import prometheus_client as prom
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.router import fast_metrics as fast
from pdserve.router.metrics import LATENCY_BUCKETS, RATIO_BUCKETS, RouterMetrics

pytestmark = pytest.mark.unit


def pair(seed: int) -> tuple[bytes, bytes]:
    out = []
    for mod in (prom, fast):
        r = CollectorRegistry()
        c = mod.Counter("t_requests", "requests", ["code"], registry=r)
        n = mod.Counter("t_tokens", "tokens", registry=r)
        g = mod.Gauge("t_inflight", "in flight", ["worker", "role"], registry=r)
        q = mod.Gauge("t_depth", "depth", registry=r)
        h = mod.Histogram("t_ttft_seconds", "ttft", buckets=LATENCY_BUCKETS, registry=r)
        m = mod.Histogram("t_match", "match", buckets=RATIO_BUCKETS, registry=r)
        ops = random.Random(seed)  # the same updates for both
        for _ in range(300):
            k = ops.randrange(7)
            if k == 0:
                c.labels(ops.choice(["200", "400", "499"])).inc()
            elif k == 1:
                n.inc(ops.randrange(100))
            elif k == 2:
                g.labels(
                    ops.choice(["http://a", "http://b"]), ops.choice(["prefill", "decode"])
                ).inc()
            elif k == 3:
                g.labels("http://a", "decode").dec()
            elif k == 4:
                q.set(ops.randrange(50))
            elif k == 5:  # on and off the bounds, past the last, zero
                h.observe(ops.choice([0.0, 0.001, 0.0025, 1e-5, 0.3, 99.0, ops.random() * 3]))
            else:
                m.observe(ops.choice([0.0, 1.0, 0.95, ops.random()]))
        out.append(generate_latest(r))
    return out[0], out[1]


@pytest.mark.parametrize("seed", range(5))
def test_renders_as_prometheus_client(seed: int) -> None:
    want, got = pair(seed)
    assert got == want
    assert b't_ttft_seconds_bucket{le="+Inf"}' in got and b"t_requests_total{code=" in got


def test_fresh_series_render_alike() -> None:
    pages = []
    for mod in (prom, fast):
        r = CollectorRegistry()
        mod.Counter("t_c", "c", registry=r)
        mod.Gauge("t_g", "g", ["x"], registry=r)
        mod.Histogram("t_h", "h", buckets=(0.1, 1.0), registry=r)
        pages.append(generate_latest(r))
    assert pages[0] == pages[1]


def test_labels_are_checked() -> None:
    c = fast.Counter("t_c", "c", ["code"])
    with pytest.raises(ValueError, match="labels"):
        c.labels()
    with pytest.raises(ValueError, match="labels"):
        c.labels("a", "b")
    assert c.labels(200) is c.labels("200")  # values as strings, one series
    assert c.labels(code="200") is c.labels("200")  # by name, as prometheus_client
    with pytest.raises(ValueError, match="labels"):
        c.labels(status="200")
    with pytest.raises(ValueError, match="labels"):
        c.labels("200", code="200")


def test_router_metrics_sample_values() -> None:
    m = RouterMetrics()
    m.child(m.requests, "200").inc()
    m.ttft.observe(0.004)
    m.prefill_queue_depth.inc()
    m.prefill_queue_depth.dec()
    m.child(m.inflight, "http://w", "decode").inc()
    r = m.registry
    assert r.get_sample_value("pdserve_router_requests_total", {"code": "200"}) == 1
    assert r.get_sample_value("pdserve_router_ttft_seconds_bucket", {"le": "0.005"}) == 1
    assert r.get_sample_value("pdserve_router_ttft_seconds_bucket", {"le": "0.0025"}) == 0
    assert r.get_sample_value("pdserve_router_ttft_seconds_count") == 1
    assert r.get_sample_value("pdserve_router_prefill_queue_depth") == 0
    labels = {"worker": "http://w", "role": "decode"}
    assert r.get_sample_value("pdserve_router_inflight_requests", labels) == 1
