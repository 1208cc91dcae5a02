"""The operator's autoscaler timer (real kopf, in-process) against the emulated API server.

The router's /metrics comes from ``autoscaler_standin``: a real HTTP server on
127.0.0.1 that stands in for the router pod (no pod runs under the emulator),
serving the router's own metric registry fed with a recorded load. The emulator
has no Deployment controller: ``controller`` below plays it (ready = desired).

- TTFT breach (prefill-bound load) → more prefill replicas, decode unchanged;
- TPOT breach (decode-bound load) → more decode replicas, prefill unchanged;
- quiet load → scale-down only after the stabilization window;
- status (lastDecision, planner state, message) and Events record why;
- router unreachable → no decision, status says why, a Warning Event, no crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
from autoscaler_standin import Load, RecordedRouter, serve_routers
from k8s_helpers import NS, eventually, minimal_llmservice, schema_errors

from pdserve.operator.autoscaler import AutoscaleSettings
from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.kube import KubeClient
from pdserve.testing.k8s_emulator import ApiServer

pytestmark = pytest.mark.timeout(150)

GVK = ("pdserve.io/v1alpha1", "LLMService")
WINDOW_S = 10  # scale-down stabilization window of the test specs

# SLO: TTFT 1 s, TPOT 100 ms. H100 / Llama-3-8B profile (the default).
# 10 req/s of 4000-token prompts = 40k prompt tokens/s, TTFT 3 s: prefill is the bottleneck.
TTFT_BREACH = Load(10, 4000, 16, ttft_s=3.0, tpot_s=0.03, decode_inflight=4, queue_depth=20)
# 600 sequences decoding at 250 ms per token, short prompts: decode is the bottleneck (the
# profile fits ~230 per replica at the SLO, so >= 3; this load had 400 while the planner
# read pdserve_router_queue_depth, every admitted request, as the prefill queue and so
# counted the decoding sequences twice; it reads pdserve_router_prefill_queue_depth now)
TPOT_BREACH = Load(4, 200, 400, ttft_s=0.3, tpot_s=0.25, decode_inflight=600, queue_depth=600)
QUIET = Load(0.5, 200, 50, ttft_s=0.1, tpot_s=0.02, decode_inflight=1, queue_depth=1)


def service(name: str) -> dict[str, Any]:
    return minimal_llmservice(
        name,
        slo={"ttftMs": 1000, "tpotMs": 100},
        prefill={"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
        decode={"replicas": 1, "minReplicas": 1, "maxReplicas": 6},
        autoscaling={
            "enabled": True,
            "intervalSeconds": 5,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": WINDOW_S,
        },
    )


def operator_config(url_template: str) -> OperatorConfig:
    return OperatorConfig(
        status_interval=0.5,
        retry_delay=0.5,
        autoscale_tick=0.5,
        autoscale=AutoscaleSettings(router_metrics_url=url_template, scrape_timeout_s=2.0),
    )


@contextlib.asynccontextmanager
async def controller(client: KubeClient, names: list[str]) -> AsyncIterator[None]:
    """The Deployment controller + kubelet: every desired pool replica becomes ready."""

    async def loop() -> None:
        while True:
            for name in names:
                for role in ("prefill", "decode"):
                    dep = await client.get("apps/v1", "Deployment", NS, f"{name}-{role}")
                    if dep is None:
                        continue
                    want = dep["spec"]["replicas"]
                    if (dep.get("status") or {}).get("readyReplicas") != want:
                        status = {"replicas": want, "updatedReplicas": want, "readyReplicas": want}
                        await client.patch(
                            "apps/v1",
                            "Deployment",
                            NS,
                            f"{name}-{role}",
                            {"status": status},
                            status=True,
                        )
            await asyncio.sleep(0.3)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def replicas(client: KubeClient, name: str, role: str) -> int:
    dep = await client.get("apps/v1", "Deployment", NS, f"{name}-{role}")
    return -1 if dep is None else int(dep["spec"]["replicas"])


async def llm(client: KubeClient, name: str) -> dict[str, Any]:
    obj = await client.get(*GVK, NS, name)
    assert obj is not None
    return obj


@pytest.fixture
def with_events(api_server: Any) -> Any:
    """Make core/v1 Events discoverable: kopf posts Events only once it has found them."""
    api_server.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", namespaced=True, verbs={"get", "list", "create", "patch"}
    )
    return api_server


def events(api_server: Any, name: str) -> list[dict[str, Any]]:
    out = []
    for o in api_server.objects.values():
        if o.deleted or "involvedObject" not in o:  # kopf posts Events without "kind"
            continue
        if o["involvedObject"].get("name") == name:
            out.append(dict(o.raw))
    return out


def assert_status_valid(obj: dict[str, Any]) -> None:
    assert schema_errors({**obj, "metadata": {"name": obj["metadata"]["name"]}}) == []


async def test_slo_breaches_scale_the_right_pool_and_quiet_scales_down(
    start_operator: Any, client: KubeClient, with_events: Any
) -> None:
    api_server = with_events
    routers = {f"{NS}/ttft": RecordedRouter(TTFT_BREACH), f"{NS}/tpot": RecordedRouter(TPOT_BREACH)}
    async with (
        serve_routers(routers) as url,
        start_operator(operator_config(url)),
        controller(client, ["ttft", "tpot"]),
    ):
        await client.create(service("ttft"))
        await client.create(service("tpot"))

        async def scaled_up() -> bool:
            return (
                await replicas(client, "ttft", "prefill") > 1
                and await replicas(client, "tpot", "decode") > 1
            )

        await eventually(scaled_up, timeout=40, what="prefill of ttft and decode of tpot up")
        # Each breach scaled its own pool only.
        assert await replicas(client, "ttft", "prefill") == 4  # need > 4: clamped to max
        # decode grows only for the KV of the prefill queue forecast to reach it (~180 4k-token
        # prompts by the time new prefill pods are ready), not to the max
        assert await replicas(client, "ttft", "decode") <= 3
        assert await replicas(client, "tpot", "decode") >= 3
        assert await replicas(client, "tpot", "prefill") == 1
        a = await llm(client, "ttft")
        auto = a["status"]["autoscaling"]
        assert auto["lastDecision"]["prefillReplicas"] == 4
        assert "prefill: scale up 1->4" in auto["lastDecision"]["reason"]
        assert auto["active"] is True and auto["metricsSource"].endswith("/default/ttft/metrics")
        plan = auto["planner"]["lastPlan"]
        assert plan["details"]["prefill_demand_tokens_per_s"] == pytest.approx(40_000, rel=0.15)
        assert auto["planner"]["state"]["prefill"]["last_target"] == 4
        # the P:D split and why (prefill minReplicas 1 here: colocation is never applied)
        assert auto["mix"]["mode"] == "disaggregated"
        assert "req/s per replica" in auto["mix"]["reason"]
        assert_status_valid(a)
        b = (await llm(client, "tpot"))["status"]["autoscaling"]["lastDecision"]
        assert "decode: scale up 1->" in b["reason"]

        async def up_events() -> Any:
            ev = [e for e in events(api_server, "ttft") if e["reason"] == "Autoscaled"]
            tpot = [e["message"] for e in events(api_server, "tpot")]
            ok = any("prefill 1->4: scale up" in e["message"] for e in ev)
            return ev if ok and any("decode 1->" in m for m in tpot) else None

        ev = await eventually(up_events, timeout=10, what="scale-up Events")
        assert all(e["type"] == "Normal" for e in ev)

        # Quiet load: held for the stabilization window, then down to the minimum.
        quiet_since = time.monotonic()
        routers[f"{NS}/ttft"].load = QUIET

        async def scaled_down() -> Any:
            obj = await llm(client, "ttft")
            last = obj["status"]["autoscaling"]["lastDecision"]
            return obj if last["prefillReplicas"] == 1 else None

        a = await eventually(scaled_down, timeout=60, what="ttft prefill back to 1")
        assert time.monotonic() - quiet_since >= WINDOW_S
        assert "prefill: scale down 2->1" in a["status"]["autoscaling"]["lastDecision"]["reason"]
        assert await replicas(client, "ttft", "prefill") == 1

        async def down_events() -> bool:  # Events are posted in the background
            downs = [e["message"] for e in events(api_server, "ttft")]
            return any("prefill 4->2: scale down" in m for m in downs) and any(
                "prefill 2->1: scale down" in m for m in downs
            )

        await eventually(down_events, timeout=10, what="scale-down Events")
        assert await replicas(client, "tpot", "decode") >= 3  # still loaded: kept
        assert_status_valid(a)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens here once the socket is closed


async def test_unreachable_router_means_no_decision_and_a_clear_message(
    start_operator: Any, client: KubeClient, with_events: Any
) -> None:
    api_server = with_events
    url = f"http://127.0.0.1:{closed_port()}/{{namespace}}/{{name}}/metrics"
    async with start_operator(operator_config(url)), controller(client, ["down"]):
        await client.create(service("down"))

        async def reported() -> Any:
            auto = (await llm(client, "down")).get("status", {}).get("autoscaling", {})
            return auto if auto.get("active") is False else None

        auto = await eventually(reported, timeout=30, what="autoscaling inactive")
        assert "unreachable" in auto["message"] and "not scaling" in auto["message"]
        await asyncio.sleep(6)  # another interval: still no decision, no crash, one warning
        obj = await llm(client, "down")
        assert "lastDecision" not in obj["status"]["autoscaling"]
        assert obj["status"]["autoscaling"]["active"] is False
        warnings = [e for e in events(api_server, "down") if e["reason"] == "MetricsUnavailable"]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning", warnings
        assert await replicas(client, "down", "prefill") == 1
        assert_status_valid(obj)


def test_crd_profile_names_are_the_planner_presets() -> None:
    from k8s_helpers import crd_schema

    from pdserve.planner.presets import PRESETS

    auto = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"]
    assert set(auto["profile"]["enum"]) == set(PRESETS)


def pod(name: str, role: str, scheduled: bool, ready: bool = False) -> dict[str, Any]:
    conditions = [{"type": "PodScheduled", "status": "True" if scheduled else "False"}]
    if scheduled:
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"pdserve.io/service": "gpu", "pdserve.io/role": role},
        },
        "status": {"phase": "Running" if ready else "Pending", "conditions": conditions},
    }


async def test_pool_status_counts_unschedulable_pods_as_pending(client: KubeClient) -> None:
    from pdserve.operator.autoscale_inputs import pool_status

    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-prefill", "namespace": NS},
        "spec": {"replicas": 4},
        "status": {"readyReplicas": 1},
    }
    await client.create(dep)
    await client.create(pod("p-ready", "prefill", scheduled=True, ready=True))
    await client.create(pod("p-starting", "prefill", scheduled=True))
    await client.create(pod("p-nogpu-1", "prefill", scheduled=False))
    await client.create(pod("p-nogpu-2", "prefill", scheduled=False))
    await client.create(pod("d-nogpu", "decode", scheduled=False))  # other pool: not counted
    status = await pool_status(client, NS, "gpu", "prefill")
    assert (status.current, status.ready, status.pending, status.starting) == (4, 1, 2, 1)


async def test_pool_status_reads_the_watch_cache_and_lists_pods_only_when_some_unready(
    api_server: ApiServer, client: KubeClient
) -> None:
    from pdserve.operator.autoscale_inputs import pool_status

    dep: dict[str, Any] = {"spec": {"replicas": 2}, "status": {"replicas": 2, "readyReplicas": 2}}

    def cached(namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        return dep if (namespace, kind, name) == (NS, "Deployment", "gpu-prefill") else None

    before = sum(api_server.requests.values())
    status = await pool_status(client, NS, "gpu", "prefill", cached)
    assert (status.current, status.ready, status.pending) == (2, 2, 0)
    assert sum(api_server.requests.values()) == before  # steady: no request at all
    dep["status"]["readyReplicas"] = 1
    await client.create(pod("p-nogpu", "prefill", scheduled=False))
    before = sum(api_server.requests.values())
    status = await pool_status(client, NS, "gpu", "prefill", cached)
    assert (status.current, status.ready, status.pending) == (2, 1, 1)
    assert sum(api_server.requests.values()) == before + 1  # one pod LIST
