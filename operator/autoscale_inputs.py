"""What the autoscaler timer reads each interval: planner config, pool counts, metrics.

- config: SLOs and pool bounds from the LLMService spec; the profile from
  ``spec.autoscaling.profile`` (a preset name) or ``profileConfigMap`` (a ConfigMap
  whose ``profile.json`` key holds the output of ``pdserve profile``).
- pools: ``current`` = Deployment ``spec.replicas``, ``ready`` = ``status.readyReplicas``,
  ``pending`` = the pool's pods that the scheduler could not place (no free GPU).
- metrics: every router replica's ``/metrics`` (the ready endpoints of its admin
  Service's EndpointSlices in-cluster: a scrape of the Service would reach one replica and
  miss the others' requests; the pages are summed), or the operator's
  ``router_metrics_url`` template, or a Prometheus HTTP API when ``metricsUrl`` is set.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

import aiohttp

from pdserve.operator import naming as n
from pdserve.operator import url_checks
from pdserve.operator.kube import KubeClient
from pdserve.operator.spec import LLMServiceSpec
from pdserve.planner.capacity import Profile, ProfileError
from pdserve.planner.config import SLO, Bounds, PlannerConfig, Stability
from pdserve.planner.metrics import MetricsError, Scrape, parse_text
from pdserve.planner.presets import PRESETS
from pdserve.planner.prometheus_api import PrometheusAPI
from pdserve.planner.snapshot import MetricsSnapshot, PoolStatus

DEFAULT_PROFILE = "h100-llama3-8b"
PROFILE_KEY = "profile.json"
# Where the router serves /metrics inside the cluster: its admin Service and port, where no
# API key is needed (the public port refuses /metrics to a keyless scrape once keys are on).
IN_CLUSTER_METRICS_URL = "http://{service}.{namespace}.svc:{port}/metrics"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


# (namespace, kind, name) -> the object as the operator's watch cache holds it, or None.
Cached = Callable[[str, str, str], "dict[str, Any] | None"]


class InputError(Exception):
    """An input the autoscaler cannot use this interval (message goes to status)."""


class PoolsMissing(InputError):
    """The pool Deployments do not exist yet (just created): nothing to plan, no alarm."""


async def load_profile(client: KubeClient, namespace: str, auto: Mapping[str, Any]) -> Profile:
    """The profile named by ``spec.autoscaling`` (ConfigMap first, else preset)."""
    cm_name = auto.get("profileConfigMap") or ""
    if cm_name:
        cm = await client.get("v1", "ConfigMap", namespace, str(cm_name))
        text = ((cm or {}).get("data") or {}).get(PROFILE_KEY)
        if text is None:
            raise InputError(f"ConfigMap {namespace}/{cm_name} has no key {PROFILE_KEY!r}")
        try:
            return Profile.from_dict(json.loads(text))
        except (ValueError, ProfileError) as exc:
            raise InputError(f"ConfigMap {namespace}/{cm_name}: bad profile: {exc}") from exc
    name = str(auto.get("profile") or DEFAULT_PROFILE)
    if name not in PRESETS:
        raise InputError(f"spec.autoscaling.profile {name!r} unknown; known: {sorted(PRESETS)}")
    return PRESETS[name]


def planner_config(svc: LLMServiceSpec, profile: Profile) -> PlannerConfig:
    auto = svc.autoscaling
    window = float(auto.scale_down_stabilization_seconds)
    stability = replace(
        Stability(),
        scale_down_window_s=window,
        scale_down_cooldown_s=min(60.0, window / 2),
        scale_up_cooldown_s=float(auto.scale_up_stabilization_seconds),
    )
    return PlannerConfig(
        slo=SLO(svc.slo.ttft_ms / 1000.0, svc.slo.tpot_ms / 1000.0, svc.slo.target_attainment),
        profile=profile,
        prefill=Bounds(svc.prefill.min_replicas, svc.prefill.max_replicas),
        decode=Bounds(svc.decode.min_replicas, svc.decode.max_replicas),
        stability=stability,
    )


def _unschedulable(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return False
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        for c in status.get("conditions") or []
    )


def _time(stamp: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_startups(pods: list[Mapping[str, Any]]) -> list[tuple[str, float]]:
    """(uid, seconds from creation to Ready) of the pods that are ready and never
    restarted (a restart's Ready is not a start-up from creation): what the planner's
    start-up estimate learns from (planner/startup.py)."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if any(c.get("restartCount", 0) for c in status.get("containerStatuses") or []):
            continue
        ready = [
            c.get("lastTransitionTime")
            for c in status.get("conditions") or []
            if c.get("type") == "Ready" and c.get("status") == "True"
        ]
        start, end = _time(meta.get("creationTimestamp")), _time(ready[0]) if ready else None
        if meta.get("uid") and start is not None and end is not None and end >= start:
            out.append((str(meta["uid"]), end - start))
    return out


async def pool_status(
    client: KubeClient,
    namespace: str,
    name: str,
    role: str,
    cached: Cached | None = None,
    on_pods: Callable[[list[Any]], None] | None = None,
) -> PoolStatus:
    """``cached`` (namespace, kind, name; ``Cache.child``) reads the operator's watch cache
    instead of a GET; pods are listed only while some pod of the pool is not ready (none can
    be pending else); ``on_pods`` sees them when they are (the start-up estimate)."""
    dep_name = n.deployment_name(name, role)
    if cached is not None:
        dep = cached(namespace, "Deployment", dep_name)
    else:
        dep = await client.get("apps/v1", "Deployment", namespace, dep_name)
    if dep is None:
        raise PoolsMissing(f"Deployment {namespace}/{dep_name} not found")
    current = int((dep.get("spec") or {}).get("replicas", 1))
    status = dep.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    pending = 0
    if max(current, int(status.get("replicas") or 0)) > ready:
        pods = await client.list("v1", "Pod", namespace, n.selector(name, role))
        pending = sum(1 for p in pods if _unschedulable(p))
        if on_pods is not None:
            on_pods(pods)
    return PoolStatus(current, min(ready, current), min(pending, current))


def router_metrics_url(template: str, name: str, namespace: str) -> str:
    return (template or IN_CLUSTER_METRICS_URL).format(
        service=n.router_admin_service_name(name),
        name=name,
        namespace=namespace,
        port=n.ADMIN_PORT,
    )


async def router_metrics_urls(
    client: KubeClient, template: str, name: str, namespace: str
) -> list[str]:
    """Every router replica's ``/metrics``: one URL per ready endpoint of the router's admin
    Service (a replica's counters count only its own requests: the planner reads their
    sum). The template's one URL when set (tests' stand-in); the Service's URL while no
    slice lists an endpoint."""
    if template:
        return [router_metrics_url(template, name, namespace)]
    service = n.router_admin_service_name(name)
    slices = await client.list(
        "discovery.k8s.io/v1", "EndpointSlice", namespace, {SERVICE_NAME_LABEL: service}
    )
    urls: set[str] = set()
    for s in slices:
        port = next((p.get("port") for p in s.get("ports") or [] if p.get("port")), n.ADMIN_PORT)
        ipv6 = s.get("addressType") == "IPv6"
        for ep in s.get("endpoints") or []:
            cond, addresses = ep.get("conditions") or {}, ep.get("addresses") or []
            if addresses and cond.get("ready") is not False and not cond.get("terminating"):
                host = f"[{addresses[0]}]" if ipv6 else addresses[0]
                urls.add(f"http://{host}:{port}/metrics")
    return sorted(urls) or [router_metrics_url("", name, namespace)]


async def scrape_routers(
    session: aiohttp.ClientSession, urls: list[str], now_s: float, timeout_s: float
) -> Scrape:
    """One scrape of every replica, their samples summed (``parse_text`` of the pages)."""
    pages = await asyncio.gather(*(_page(session, u, timeout_s) for u in urls))
    try:
        return parse_text(list(pages), now_s)
    except MetricsError as exc:
        raise InputError(f"router metrics {', '.join(urls)}: {exc}") from exc


async def scrape_router(
    session: aiohttp.ClientSession, url: str, now_s: float, timeout_s: float
) -> Scrape:
    return await scrape_routers(session, [url], now_s, timeout_s)


async def _page(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise InputError(f"router metrics {url}: HTTP {resp.status}")
            return text
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise InputError(f"router metrics {url} unreachable: {exc or type(exc).__name__}") from exc


async def prometheus_snapshot(
    svc: LLMServiceSpec,
    now_s: float,
    pools: tuple[PoolStatus, PoolStatus],
    slo: SLO,
    allow: tuple[str, ...] = (),
) -> MetricsSnapshot:
    """One window of the LLMService's series from Prometheus (ServiceMonitor target labels),
    fetched from the one address checked (url_checks.pin; ``allow``: the admin's CIDRs)."""
    selector = f'namespace="{svc.namespace}",pdserve_io_service="{svc.name}"'
    window = max(30.0, float(svc.autoscaling.interval_seconds))

    def query() -> MetricsSnapshot:
        try:  # resolved once, here; the connection goes to that address
            client = url_checks.pinned_client(svc.autoscaling.metrics_url, allow)
        except ValueError as exc:
            raise InputError(f"spec.autoscaling.metricsUrl: {exc}") from None
        with client as http:
            api = PrometheusAPI(
                svc.autoscaling.metrics_url,
                selector=selector,
                window_s=window,
                client=http,
                quiet=True,
            )
            return api.snapshot(now_s, pools[0], pools[1], slo)

    try:
        return await asyncio.to_thread(query)
    except MetricsError as exc:
        raise InputError(str(exc)) from exc
