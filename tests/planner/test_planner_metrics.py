"""Snapshots from Prometheus text (two scrapes) and from the Prometheus HTTP API."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from planner_helpers import FakeRouter

from pdserve.planner import histogram
from pdserve.planner.config import SLO
from pdserve.planner.metrics import MetricsError, parse_text, snapshot_from_scrapes
from pdserve.planner.prometheus_api import PrometheusAPI
from pdserve.planner.snapshot import PoolStatus

pytestmark = pytest.mark.unit

SLO_ = SLO(ttft_s=1.0, tpot_s=0.05)
P, D = PoolStatus(2, 2), PoolStatus(3, 2, 1)


def test_two_scrapes_give_rates_quantiles_and_attainment() -> None:
    router = FakeRouter()
    router.ttft.observe(9.0)  # before the interval: must not count
    router.requests.labels("200").inc(5)
    first = parse_text(router.text(), time_s=100.0)
    rng = np.random.default_rng(0)
    ttfts = rng.uniform(0.1, 2.0, 400)
    for x in ttfts:
        router.ttft.observe(x)
    for x in rng.uniform(0.01, 0.1, 400):
        router.tpot.observe(x)
    router.requests.labels("200").inc(380)
    router.requests.labels("429").inc(20)
    router.prompt.inc(400_000)
    router.output.inc(80_000)
    router.hits.labels("prefill").inc(100_000)
    router.depth.set(7)
    for w in (0.1, 0.3):
        router.wait.labels("prefill").observe(w)
    router.running.labels("decode").set(120)
    router.kv_total.labels("decode").set(1000)
    router.kv_free.labels("decode").set(250)
    second = parse_text(router.text(), time_s=110.0)

    s = snapshot_from_scrapes(first, second, P, D, SLO_)
    assert s.interval_s == 10.0 and s.prefill == P and s.decode == D
    assert s.request_rate == pytest.approx(40.0)
    assert s.prompt_token_rate == pytest.approx(40_000.0)
    assert s.output_token_rate == pytest.approx(8_000.0)
    assert s.cached_token_fraction == pytest.approx(0.25)
    assert s.ttft.count == 400
    assert s.ttft.mean == pytest.approx(ttfts.mean())
    # interpolated quantile of a uniform sample, resolution of the bucket layout
    assert s.ttft.p50 == pytest.approx(np.median(ttfts), abs=0.1)
    assert s.ttft.attainment == pytest.approx((ttfts <= 1.0).mean(), abs=1e-9)
    assert s.prefill_queue_depth == 7
    assert s.prefill_queue_wait_s == pytest.approx(0.2)
    assert s.decode_running == 120
    assert s.kv_utilisation == pytest.approx(0.75)


def test_prefill_queue_is_the_routers_prefill_gauge() -> None:
    """The router's pdserve_router_prefill_queue_depth (requests before their first token)
    is the prefill queue: neither every admitted request (pdserve_router_queue_depth, what
    routers of earlier weeks were read by) nor the prefill workers' waiting ones add to it."""
    old = 'pdserve_router_queue_depth 30\npdserve_num_requests_waiting{role="prefill"} 4\n'
    new = old + "pdserve_router_prefill_queue_depth 6\n"
    for text, depth in ((old, 0), (new, 6)):
        scrape = parse_text(text, time_s=10.0)
        s = snapshot_from_scrapes(parse_text("", time_s=0.0), scrape, P, D, SLO_)
        assert s.prefill_queue_depth == depth


def recorded_router(ttft: tuple[int, int, int], ttft_sum: float, ok: int) -> str:
    """A router's /metrics as scraped: the TTFT histogram (cumulative counts at 0.5 s, 1 s
    and +Inf) and the count of 200 responses."""
    le_half, le_one, count = ttft
    return f"""\
# TYPE pdserve_router_ttft_seconds histogram
pdserve_router_ttft_seconds_bucket{{le="0.5"}} {le_half}
pdserve_router_ttft_seconds_bucket{{le="1.0"}} {le_one}
pdserve_router_ttft_seconds_bucket{{le="+Inf"}} {count}
pdserve_router_ttft_seconds_count {count}
pdserve_router_ttft_seconds_sum {ttft_sum}
# TYPE pdserve_router_requests_total counter
pdserve_router_requests_total{{code="200"}} {ok}
"""


RECORDED_1 = (
    recorded_router((10, 20, 20), 10.0, 1000)
    + """\
# TYPE pdserve_router_inflight_requests gauge
pdserve_router_inflight_requests{worker="d0",role="decode"} 4
pdserve_router_inflight_requests{worker="d1",role="decode"} 6
pdserve_router_inflight_requests{worker="p0",role="prefill"} 9
"""
)

# the router restarted: counters went back down (a reset, not a negative rate)
RECORDED_2 = recorded_router((2, 3, 4), 4.0, 30)


def test_recorded_text_with_counter_reset_and_router_inflight_fallback() -> None:
    a, b = parse_text(RECORDED_1, 0.0), parse_text(RECORDED_2, 15.0)
    assert a.total("pdserve_router_inflight_requests", role="decode") == 10
    s = snapshot_from_scrapes(a, b, P, D, SLO_)
    assert s.request_rate == pytest.approx(2.0)
    assert s.ttft.count == 4 and s.ttft.mean == pytest.approx(1.0)
    assert s.ttft.attainment == pytest.approx(0.75)
    assert s.ttft.p90 == 1.0  # rank in the +Inf bucket: the largest finite bound
    s = snapshot_from_scrapes(parse_text("", -10.0), a, P, D, SLO_)
    assert s.decode_running == 10  # no worker gauges: the router's in-flight count


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(MetricsError, match="cannot parse"):
        parse_text("pdserve_router_requests_total{code=200 oops\n", 0.0)
    a = parse_text(RECORDED_1, 5.0)
    with pytest.raises(MetricsError, match="time order"):
        snapshot_from_scrapes(a, a, P, D, SLO_)


def test_histogram_helpers() -> None:
    b = [(1.0, 10.0), (2.0, 30.0), (float("inf"), 40.0)]
    assert histogram.quantile(b, 0.5) == pytest.approx(1.5)
    assert histogram.fraction_within(b, 1.5) == pytest.approx(0.5)
    assert histogram.fraction_within(b, 5.0) == pytest.approx(0.75)
    assert histogram.quantile([], 0.9) == 0.0
    assert histogram.delta([(1.0, 5.0)], [(1.0, 7.0)]) == [(1.0, 5.0)]


def test_prometheus_api_snapshot_from_recorded_replies() -> None:
    # A Prometheus server cannot run here: httpx.MockTransport answers with replies in
    # the documented /api/v1/query format, keyed by the PromQL the client sends.
    def vec(*rows):
        result = [{"metric": labels, "value": [1.7e9, str(v)]} for labels, v in rows]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    ttft = "pdserve_router_ttft_seconds"
    sel = '{namespace="prod"}'
    replies = {
        f"sum(increase(pdserve_router_requests_total{sel}[60s]))": vec(({}, 600)),
        f"sum(increase(pdserve_router_prompt_tokens_total{sel}[60s]))": vec(({}, 6e5)),
        f"sum by (le) (increase({ttft}_bucket{sel}[60s]))": vec(
            ({"le": "0.5"}, 300), ({"le": "1"}, 540), ({"le": "+Inf"}, 600)
        ),
        f"sum(increase({ttft}_count{sel}[60s]))": vec(({}, 600)),
        f"sum(increase({ttft}_sum{sel}[60s]))": vec(({}, 360)),
        f"sum by (role) (pdserve_num_requests_running{sel})": vec(
            ({"role": "decode"}, 50), ({"role": "prefill"}, 3)
        ),
    }
    seen = []
    at = set()  # every query of one snapshot at its instant, not at the server's "now"

    def handler(request: httpx.Request) -> httpx.Response:
        q = request.url.params["query"]
        seen.append(q)
        at.add(request.url.params.get("time"))
        return httpx.Response(200, json=replies.get(q, vec()))

    client = httpx.Client(transport=httpx.MockTransport(handler))
    api = PrometheusAPI("http://prom:9090", selector='namespace="prod"', client=client)
    s = api.snapshot(1000.0, P, D, SLO_)
    assert s.request_rate == pytest.approx(10.0)
    assert s.prompt_token_rate == pytest.approx(1e4)
    assert s.ttft.count == 600 and s.ttft.mean == pytest.approx(0.6)
    assert s.ttft.attainment == pytest.approx(0.9)
    assert s.decode_running == 50
    assert len(seen) == len(set(seen)) >= 20
    assert at == {"1000.000"}

    def failing(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"status": "error", "error": "parse error"})

    bad = PrometheusAPI(
        "http://prom:9090", client=httpx.Client(transport=httpx.MockTransport(failing))
    )
    with pytest.raises(MetricsError, match="parse error"):
        bad.snapshot(1000.0, P, D, SLO_)
    with pytest.raises(MetricsError, match="http"):
        PrometheusAPI("prom:9090")
    assert json.dumps(vec(({}, 1)))  # the fixture itself is valid JSON
