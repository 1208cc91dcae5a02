"""The autoscaler: a kopf timer per LLMService whose ``spec.autoscaling.enabled`` is true.

Every ``spec.autoscaling.intervalSeconds``: read the pools' replica counts, scrape
the router's ``/metrics`` (or query Prometheus when ``metricsUrl`` is set), run the
planner (``pdserve.planner.plan``) against the previous scrape and the carried
state, scale the pools through ``scaling.scale_pools`` when a count changes, and
record why:

- ``status.autoscaling.lastDecision``: the last scaling (time, replicas, reason);
- ``status.autoscaling.planner``: the carried planner state and this interval's plan
  (the state survives an operator restart through it);
- ``status.autoscaling.mix``: the prefill:decode split in force (``disaggregated`` or
  ``colocated``: no prefill pool, decode workers prefill locally) and why (goodput per
  replica of both; colocation needs the prefill pool's ``minReplicas: 0``);
- ``status.autoscaling.active`` / ``message`` / ``metricsSource`` /
  ``lastEvaluationTime``: whether the last interval could plan, and if not, why
  (e.g. the router is not reachable: no decision is made, nothing is scaled);
- Events: ``Normal Autoscaled`` per scaling, ``Warning MetricsUnavailable`` when
  the inputs stop being readable.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import kopf

from pdserve.operator import autoscale_inputs as inputs
from pdserve.operator import naming as n
from pdserve.operator import status as st
from pdserve.operator.kube import KubeClient
from pdserve.operator.scaling import ScalingRefused, scale_pools
from pdserve.operator.spec import LLMServiceSpec, SpecError
from pdserve.operator.spec_parse import parse_llmservice
from pdserve.planner.decision import Decision, PlannerState
from pdserve.planner.metrics import Scrape, snapshot_from_scrapes
from pdserve.planner.plan import plan
from pdserve.planner.snapshot import MetricsSnapshot, PoolStatus
from pdserve.planner.startup import StartupEstimate


@dataclass(frozen=True)
class AutoscaleSettings:
    # Router /metrics URL template ({service}, {name}, {namespace}, {port}); empty: the
    # router Service in-cluster. Tests point it at a local stand-in for the router.
    router_metrics_url: str = ""
    scrape_timeout_s: float = 5.0
    # CIDRs spec.autoscaling.metricsUrl may resolve into (--metrics-url-allow); empty: any
    # address but metadata, link-local, loopback and unspecified (operator/url_checks.py).
    metrics_url_allow: tuple[str, ...] = ()


@dataclass
class AutoscalerMemo:
    """Per-object memory between intervals (kopf's per-object memo holds it)."""

    prev: Scrape | None = None  # the last router scrape (rates are differences)
    source: str = ""  # where ``prev`` came from; a new source starts over
    state: PlannerState | None = None  # None: restore from status (operator restarted)
    last_run_s: float | None = None
    inputs_ok: bool = True  # for a Warning Event only when inputs become unavailable
    # the pools' start-up, learned from their pods (creation to Ready); the planner sizes
    # for it instead of the default startup_s once a pod has been timed
    startup: StartupEstimate | None = None
    timed: set[str] = field(default_factory=set)  # pod uids already counted

    def learn(self, role: str) -> Callable[[list[Any]], None]:
        def seen(pods: list[Any]) -> None:
            assert self.startup is not None
            for uid, seconds in inputs.pod_startups(pods):
                if uid not in self.timed:
                    self.timed.add(uid)
                    self.startup.observe(role, seconds)

        return seen


def _autoscaler_memo(memo: Any) -> AutoscalerMemo:
    if getattr(memo, "autoscaler", None) is None:
        memo.autoscaler = AutoscalerMemo()
    am: AutoscalerMemo = memo.autoscaler
    return am


async def autoscale(
    *,
    body: Any,
    name: str,
    namespace: str,
    memo: Any,
    client: KubeClient,
    lock: asyncio.Lock,
    settings: AutoscaleSettings,
    logger: Any,
    cached: inputs.Cached | None = None,
) -> None:
    """Timer body (called every tick); runs one planner interval when one is due."""
    am = _autoscaler_memo(memo)
    # ``body`` is the watch cache's copy (handlers.py): no GET per tick per object.
    fresh = body
    if fresh is None or fresh["metadata"].get("deletionTimestamp"):
        return
    try:
        svc = parse_llmservice(fresh, namespace)
    except SpecError:
        return  # Degraded is reported by the change handlers
    now = time.time()
    due = am.last_run_s is None or now - am.last_run_s >= svc.autoscaling.interval_seconds - 0.5
    if not svc.autoscaling.enabled or not due:
        return
    am.last_run_s = now
    status = (fresh.get("status") or {}).get("autoscaling") or {}
    if am.state is None:
        am.state = PlannerState.from_dict((status.get("planner") or {}).get("state"))
    raw_auto = (fresh.get("spec") or {}).get("autoscaling") or {}
    try:
        config = inputs.planner_config(svc, await inputs.load_profile(client, namespace, raw_auto))
        am.startup = am.startup or StartupEstimate(config.startup_s)
        pools = (
            await inputs.pool_status(
                client, namespace, name, "prefill", cached, am.learn("prefill")
            ),
            await inputs.pool_status(client, namespace, name, "decode", cached, am.learn("decode")),
        )
        config = replace(config, startup_s=am.startup.planner_startup_s())
        snap, source = await _snapshot(client, svc, am, settings, now, pools, config.slo)
    except inputs.PoolsMissing:
        am.last_run_s = None  # not created yet: try again next tick, quietly
        return
    except inputs.InputError as exc:
        await _unavailable(client, body, svc, am, str(exc), logger)
        return
    am.inputs_ok = True
    if snap is None:
        message = "first scrape; the planner decides from the next interval"
        await _record(client, svc, {"active": True, "message": message, "metricsSource": source})
        return
    decision, am.state = plan(snap, am.state, config)
    await _apply(client, body, svc, lock, decision, am.state, source, logger)


async def _snapshot(
    client: KubeClient,
    svc: LLMServiceSpec,
    am: AutoscalerMemo,
    settings: AutoscaleSettings,
    now: float,
    pools: tuple[PoolStatus, PoolStatus],
    slo: Any,
) -> tuple[MetricsSnapshot | None, str]:
    if svc.autoscaling.metrics_url:  # Prometheus gives a whole window per query
        url = svc.autoscaling.metrics_url
        snap = await inputs.prometheus_snapshot(svc, now, pools, slo, settings.metrics_url_allow)
        return snap, url
    urls = await inputs.router_metrics_urls(
        client, settings.router_metrics_url, svc.name, svc.namespace
    )
    # A changed set of replicas starts over (sums of different replicas are no rates).
    url = " ".join(urls)
    async with aiohttp.ClientSession() as session:
        # stamped at the request: the rates' interval is the one between two scrapes
        scrape = await inputs.scrape_routers(session, urls, time.time(), settings.scrape_timeout_s)
    prev = am.prev if am.source == url else None
    am.prev, am.source = scrape, url
    if prev is None or scrape.time_s <= prev.time_s:
        return None, url
    return snapshot_from_scrapes(prev, scrape, pools[0], pools[1], slo), url


async def _apply(
    client: KubeClient,
    body: Any,
    svc: LLMServiceSpec,
    lock: asyncio.Lock,
    decision: Decision,
    state: PlannerState,
    source: str,
    logger: Any,
) -> None:
    changed = [p for p in (decision.prefill, decision.decode) if p.changed]
    async with lock:  # reconciliation must not apply a stale replica count meanwhile
        if changed:
            try:
                await scale_pools(
                    client,
                    svc.namespace,
                    svc.name,
                    decision.prefill.desired,
                    decision.decode.desired,
                    decision.reason,
                )
            except ScalingRefused as exc:
                logger.info(f"autoscaler: not scaling: {exc}")
                return
        planner = {"state": _json_safe(state.to_dict()), "lastPlan": _json_safe(decision.to_dict())}
        mix = {"mode": decision.mode, "reason": decision.mix_reason}  # which P:D split, and why
        await _record(
            client,
            svc,
            {
                "active": True,
                "message": decision.reason,
                "metricsSource": source,
                "planner": planner,
                "mix": mix,
            },
        )
    if changed:
        message = "; ".join(f"{p.role} {p.current}->{p.desired}: {p.reason}" for p in changed)
        kopf.event(body, type="Normal", reason="Autoscaled", message=message)
        logger.debug(f"autoscaler: {message}")


async def _unavailable(
    client: KubeClient,
    body: Any,
    svc: LLMServiceSpec,
    am: AutoscalerMemo,
    message: str,
    logger: Any,
) -> None:
    """No decision this interval: say why in status; one Warning Event per outage."""
    if am.inputs_ok:
        kopf.warn(body, reason="MetricsUnavailable", message=f"{message}; not scaling")
        logger.warning(f"autoscaler: {message}; not scaling")
    am.inputs_ok = False
    await _record(client, svc, {"active": False, "message": f"{message}; not scaling"})


async def _record(client: KubeClient, svc: LLMServiceSpec, fields: dict[str, Any]) -> None:
    patch = {"status": {"autoscaling": {**fields, "lastEvaluationTime": st.now()}}}
    await client.patch(n.API_VERSION, n.KIND, svc.namespace, svc.name, patch, status=True)


def _json_safe(value: Any) -> Any:
    """Lists for tuples; non-finite floats dropped (JSON has no inf/NaN)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items() if _finite(v)}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)
