"""The operator's PromQL (``spec.autoscaling.metricsUrl``) answered by a real Prometheus.

Debian's ``prometheus`` scrapes the shared ``pdserve up`` (router and both workers, every
second, with the target labels a ServiceMonitor adds); the operator's own query path
(``autoscale_inputs.prometheus_snapshot``: its selector, its window, its PromQL) reads the
planner's snapshot from it, and the planner decides on that snapshot. Each test starts its
own Prometheus, so its window holds only the test's own requests.

Beside the parallel suite Prometheus' 1 s scrapes land late and unevenly, so nothing here
compares numbers read at different moments: once the load is done and scraped, the raw
counters Prometheus stored are read at one instant ``T`` and must equal the router's own
(read after that scrape), and the operator's snapshot is evaluated at ``T`` too (every
query of it at one instant), where every router counter of one scrape is extrapolated by
the same factor, so the ratios of its increases are the router's ratios.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import yaml

from pdserve.env import REQUIRE_PROMETHEUS
from pdserve.operator import autoscale_inputs as inputs
from pdserve.operator import url_checks
from pdserve.operator.spec_parse import parse_llmservice
from pdserve.planner import metrics as m
from pdserve.planner.capacity import PrefillProfile
from pdserve.planner.decision import PlannerState
from pdserve.planner.metrics import parse_text
from pdserve.planner.plan import plan
from pdserve.planner.presets import CPU_TINY
from pdserve.planner.snapshot import MetricsSnapshot, PoolStatus
from pdserve.testing.loopback import ROOT, secret_auth
from pdserve.testing.prometheus import Prometheus, prometheus_binary, run_prometheus
from pdserve.testing.up import Up

# serial: alone (its own shared `pdserve up`, first user) these checks held in every run
# under load; in the parallel part, after other modules on the shared `pdserve up`, one run
# of three modules (-n 2) saw the window's mean TTFT 10% under the router's delta, with
# requests, prompt tokens and the raw counters exact (cause not found: suspect a TTFT
# observed between Prometheus' first scrape and the test's first read, from an earlier
# module's request). make test runs these alone afterwards until that is understood.
pytestmark = [pytest.mark.cluster, pytest.mark.serial]

NAMESPACE, SERVICE = "pdserve-test", "chat"
POOLS = (PoolStatus(1, 1), PoolStatus(1, 1))  # what the Deployments say: one ready replica each
PROMPT = "the quick brown fox jumps over the lazy dog " * 16  # ~150 tokens
# The operator's window is max(30 s, intervalSeconds): 60 s holds a whole test (Prometheus'
# start, its load, the scrape after it) on a loaded machine, so the window's first samples
# are from before the load.
INTERVAL_S = 60
# Requests sent before Prometheus starts: every series exists before its first scrape, and
# each router counter's first value is at least about the load's increase, so Prometheus
# never stops a counter's extrapolation where it would reach zero (which it would do per
# series, at different points for a request count and a token count).
PRIME = 8


@pytest.fixture(autouse=True)
def _installed() -> None:
    if prometheus_binary() is None:
        msg = "prometheus is not installed (scripts/setup.sh installs Debian's package)"
        if os.environ.get(REQUIRE_PROMETHEUS):
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture
def loopback_metrics_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator refuses loopback metrics URLs (its own pod); here Prometheus is on
    loopback, so loopback alone is let through (the --metrics-url-allow check still runs)."""
    strict = url_checks.forbidden_address

    def forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
        return "" if ip.is_loopback else strict(ip)

    monkeypatch.setattr(url_checks, "forbidden_address", forbidden)


@pytest.fixture
def prom(up: Up, client: openai.OpenAI, loopback_metrics_url: None) -> Iterator[Prometheus]:
    # Requests first: a counter series (per status, per role) is born at its first
    # increment, and increase() counts only what changes after a series' first sample.
    _send(client, PRIME, concurrency=4)
    jobs = {"router": [_hostport(up.url)], "workers": [_hostport(u) for u in up.workers]}
    labels = {"namespace": NAMESPACE, "pdserve_io_service": SERVICE}
    with run_prometheus(jobs, labels, interval_s=1.0) as server:
        yield server


def _hostport(url: str) -> str:
    return urlsplit(url).netloc


def _snapshot(
    prom: Prometheus, at: float | None = None, slo_ttft_ms: int = 2000
) -> tuple[MetricsSnapshot, object]:
    """The operator's Prometheus snapshot of an LLMService pointed at ``prom``, at ``at``
    (Unix seconds; now if None)."""
    body = yaml.safe_load((ROOT / "examples/llmservice-cpu.yaml").read_text())
    body["metadata"] = {"name": SERVICE, "namespace": NAMESPACE, "generation": 1}
    auto = {"enabled": True, "metricsUrl": prom.url, "intervalSeconds": INTERVAL_S}
    body["spec"]["autoscaling"] = auto
    body["spec"]["slo"]["ttftMs"] = slo_ttft_ms
    svc = parse_llmservice(body, NAMESPACE)
    slo = inputs.planner_config(svc, CPU_TINY).slo
    now = time.time() if at is None else at
    snap = asyncio.run(inputs.prometheus_snapshot(svc, now, POOLS, slo, allow=("127.0.0.0/8",)))
    return snap, svc


COUNTERS = (m.ROUTER_REQUESTS, m.ROUTER_PROMPT_TOKENS, m.ROUTER_TTFT + "_count")
SUMS = (m.ROUTER_TTFT + "_sum",)  # a float: its sum over series is compared approximately


def _router_counts(up: Up) -> dict[str, float]:
    scrape = parse_text([httpx.get(up.url + "/metrics", timeout=5).text], time.time())
    return {name: scrape.total(name) or 0.0 for name in (*COUNTERS, *SUMS)}


def _send(client: openai.OpenAI, n: int, concurrency: int) -> None:
    model = client.models.list().data[0].id

    def one(i: int) -> None:
        client.completions.create(model=model, prompt=f"{i} {PROMPT}", max_tokens=4)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(n)))


def _settled(prom: Prometheus, up: Up) -> tuple[dict[str, float], float]:
    """The router's counters now, and an instant by which Prometheus has stored a scrape
    that shows them (the load is done: they do not move after it)."""
    after = _router_counts(up)
    total = after[m.ROUTER_REQUESTS]
    prom.wait_scraped(f'sum({m.ROUTER_REQUESTS}{{namespace="{NAMESPACE}"}})', total)
    return after, time.time()


def test_operator_promql_is_answered_by_real_prometheus(
    up: Up, client: openai.OpenAI, prom: Prometheus
) -> None:
    before = _router_counts(up)
    n = 12
    _send(client, n, concurrency=3)
    after, at = _settled(prom, up)
    delta = {k: after[k] - before[k] for k in after}
    assert delta[m.ROUTER_REQUESTS] == n, delta
    # what Prometheus stored, read at one instant, is what the router counted
    for name in (*COUNTERS, *SUMS):
        stored = prom.value(f'sum({name}{{namespace="{NAMESPACE}"}})', at=at)
        assert stored == pytest.approx(after[name], rel=1e-9, abs=0), (name, stored, after)
    snap, svc = _snapshot(prom, at=at)
    window = snap.interval_s
    assert window == INTERVAL_S  # the operator's window: max(30 s, intervalSeconds)
    # increase() extrapolates a little past the window's first and last samples: by one
    # factor for every router counter of one scrape (same sample times, and no counter's
    # extrapolation stopped at zero: PRIME), at least 1 (the whole load is in the window)
    # and under 2 (Prometheus was started seconds before; a double count would be 2)
    factor = snap.request_rate * window / n
    assert 1.0 <= factor < 2.0, factor
    assert abs(snap.ttft.count - n * factor) <= 1, (snap.ttft, factor)  # count is rounded
    # ratios of two increases of one scrape: the factor cancels; a wrong metric, unit,
    # selector or window is off by far more than 1%
    want_prompt = delta[m.ROUTER_PROMPT_TOKENS] / n
    assert snap.mean_prompt_tokens == pytest.approx(want_prompt, rel=0.01)
    want_mean = delta[m.ROUTER_TTFT + "_sum"] / delta[m.ROUTER_TTFT + "_count"]
    assert snap.ttft.mean == pytest.approx(want_mean, rel=0.01)
    assert 0 < snap.ttft.attainment <= 1
    # gauges: the workers' own /stats, by role
    stats = [httpx.get(u + "/stats", timeout=5, auth=secret_auth()).json() for u in up.workers]
    kv_total = prom.query(f'sum by (role) ({m.KV_TOTAL}{{namespace="{NAMESPACE}"}})', at=at)
    by_role = {row["metric"]["role"]: float(row["value"][1]) for row in kv_total}
    assert sum(by_role.values()) == sum(s["kv_blocks_total"] for s in stats), by_role
    assert set(by_role) == {"prefill", "decode"}
    # the gauges are instantaneous: the scrape in the snapshot may have caught the last
    # stream's end; the next scrapes (1 s apart) must show the pool idle
    deadline = time.monotonic() + 10
    while (snap.decode_running or snap.decode_waiting) and time.monotonic() < deadline:
        time.sleep(1)
        snap, _ = _snapshot(prom)
    assert snap.decode_running == 0 and snap.decode_waiting == 0, snap
    assert 0 <= snap.kv_utilisation < 1
    assert svc.autoscaling.metrics_url == prom.url


def test_a_load_step_seen_through_prometheus_scales_the_prefill_pool(
    up: Up, client: openai.OpenAI, prom: Prometheus
) -> None:
    # A profile whose prefill replica serves 10 prompt tokens/s (the planner's capacity
    # model; its decode replica the CPU preset's): the step below, 16 prompts of ~150
    # tokens, is ~4x one prefill replica over the operator's 60 s window, and decode
    # sequences (4 tokens each) are far below one decode replica's batch.
    profile = replace(CPU_TINY, prefill=PrefillProfile(0.02, 10.0, 2048))
    quiet, svc = _snapshot(prom, slo_ttft_ms=500)
    config = inputs.planner_config(svc, profile)
    calm, _ = plan(quiet, PlannerState(), config)
    assert quiet.request_rate == 0, quiet
    assert (calm.prefill.desired, calm.decode.desired) == (1, 1), calm.to_dict()
    _send(client, 16, concurrency=4)
    _, at = _settled(prom, up)
    step, _ = _snapshot(prom, at=at, slo_ttft_ms=500)
    decision, _ = plan(step, PlannerState(), config)
    assert step.request_rate * step.interval_s >= 16, step  # the step, as Prometheus saw it
    assert step.prompt_token_rate > 2 * profile.prefill.tokens_per_s, step
    assert decision.details["prefill_need"] > 2, decision.details
    assert decision.prefill.desired >= 2, decision.to_dict()
    assert decision.prefill.desired > decision.prefill.current
    assert decision.decode.desired == 1, decision.to_dict()
