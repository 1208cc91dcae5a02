"""kopf handlers for LLMService: one per cause, registered on a given registry.

create / update / resume → ``reconcile``: parse, preflight, render, adopt, apply.
delete → take the router off the network first; owner references collect the rest.
timer → re-apply children (reverts manual edits) and write observed state to status.
autoscaler timer (only with spec.autoscaling.enabled) → ``autoscaler.autoscale``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from pdserve.operator import autoscaler, kube, preflight, reconcile, render
from pdserve.operator import naming as n
from pdserve.operator import status as st
from pdserve.operator.spec import LLMServiceSpec, SpecError
from pdserve.operator.spec_parse import parse_llmservice


@dataclass(frozen=True)
class OperatorConfig:
    status_interval: float = 10.0  # timer period: observed state → status, drift repair
    retry_delay: float = 30.0  # TemporaryError delay when a referenced object is missing
    autoscale_tick: float = 5.0  # autoscaler timer period; each object plans every intervalSeconds
    autoscale: autoscaler.AutoscaleSettings = field(default_factory=autoscaler.AutoscaleSettings)


def _client(memo: Any) -> kube.KubeClient:
    client = getattr(memo, "client", None)
    assert client is not None, "the startup handler creates the client before any resource handler"
    return client


def _lock(memo: Any) -> asyncio.Lock:
    # Per-object memo: the timer and the change handlers must not apply children concurrently.
    if getattr(memo, "lock", None) is None:
        memo.lock = asyncio.Lock()
    lock: asyncio.Lock = memo.lock
    return lock


def _parse(name: str, namespace: str, spec: Any) -> LLMServiceSpec:
    return parse_llmservice(
        {"metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)}
    )


async def _write_status(
    client: kube.KubeClient, namespace: str, name: str, fresh: Mapping[str, Any] | None,
    conditions: list[dict[str, Any]], extra: Mapping[str, Any],
) -> None:  # fmt: skip
    """Merge ``conditions`` into the *fresh* status and patch it (call under the object's lock).

    Handlers and the timer both write conditions, a list that a merge patch replaces
    whole: each read-modify-write happens under one per-object lock on a fresh read,
    so neither overwrites the other's newer condition with a stale copy.
    """
    if fresh is None:
        return
    old = (fresh.get("status") or {}).get("conditions") or []
    new = {"conditions": st.merge_conditions(list(old), conditions), **extra}
    if not reconcile.contains(fresh.get("status") or {}, new):
        await client.patch(n.API_VERSION, n.KIND, namespace, name, {"status": new}, status=True)


async def _degrade(
    client: kube.KubeClient, namespace: str, name: str, message: str, generation: int | None
) -> None:
    fresh = await client.get(n.API_VERSION, n.KIND, namespace, name)
    old = ((fresh or {}).get("status") or {}).get("conditions") or []
    new = [st.condition("Degraded", True, st.REASON_INVALID_SPEC, message, generation)]
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in old):
        new.append(st.condition("Ready", False, st.REASON_INVALID_SPEC, message, generation))
    await _write_status(client, namespace, name, fresh, new, {})


async def reconcile_object(
    *, body: Any, spec: Any, name: str, namespace: str, meta: Any, memo: Any,
    config: OperatorConfig, logger: Any,
) -> reconcile.ApplyResult:  # fmt: skip
    generation = meta.get("generation")
    client = _client(memo)
    async with _lock(memo):
        try:
            svc = _parse(name, namespace, spec)
        except SpecError as e:
            await _degrade(client, namespace, name, str(e), generation)
            raise kopf.PermanentError(f"invalid spec: {e}") from e  # only an edit can fix it
        problems = await preflight.preflight(client, svc)
        if problems:
            message = "; ".join(str(p) for p in problems)
            await _degrade(client, namespace, name, message, generation)
            if all(p.retryable for p in problems):  # e.g. the Secret is created right after us
                raise kopf.TemporaryError(message, delay=config.retry_delay)
            raise kopf.PermanentError(message)
        children = render.render_spec(svc)
        kopf.adopt(children, owner=body)
        result = await reconcile.apply_children(client, svc, children)
        keep = {reconcile.key_of(c) for c in children}
        optional = render.optional_children(name)
        pruned = await reconcile.prune_children(client, namespace, meta["uid"], optional, keep)
        fresh = await client.get(n.API_VERSION, n.KIND, namespace, name)
        ok = st.condition("Degraded", False, "AsExpected", "spec applied", generation)
        await _write_status(
            client, namespace, name, fresh, [ok], {"observedGeneration": generation}
        )
    done = {"created": result.created, "patched": result.patched, "pruned": pruned}
    logger.info(f"applied: {', '.join(f'{k}={list(v)}' for k, v in done.items())}")
    return result


async def observe(*, body: Any, name: str, namespace: str, memo: Any, logger: Any) -> None:
    """Timer body: repair drift when the current generation was applied, then write status."""
    client = _client(memo)
    async with _lock(memo):
        fresh = await client.get(n.API_VERSION, n.KIND, namespace, name)
        if fresh is None or fresh["metadata"].get("deletionTimestamp"):
            return
        try:
            svc = _parse(name, namespace, fresh.get("spec") or {})
        except SpecError:
            return  # Degraded is already reported by the change handler
        status = fresh.get("status") or {}
        applied = status.get("observedGeneration") == fresh["metadata"].get("generation")
        degraded = any(c.get("reason") == st.REASON_INVALID_SPEC and c.get("status") == "True"
                       for c in status.get("conditions") or [])  # fmt: skip
        if applied and not degraded:
            children = render.render_spec(svc)
            kopf.adopt(children, owner=body)
            result = await reconcile.apply_children(client, svc, children)
            if result.patched or result.created:
                logger.info(f"reverted drift: {list(result.created) + list(result.patched)}")
        deployments = {
            role: await client.get(
                "apps/v1", "Deployment", namespace, n.deployment_name(name, role)
            )
            for role in n.ROLES
        }
        new = st.observed_status(
            svc, status.get("observedGeneration"), deployments, status.get("conditions") or []
        )
        conditions = new.pop("conditions")
        await _write_status(client, namespace, name, fresh, conditions, new)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig = OperatorConfig()) -> None:
    """Register all LLMService handlers on ``registry`` (kopf's default one for ``kopf run``)."""
    res = (n.GROUP, n.VERSION, n.PLURAL)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        settings.persistence.finalizer = f"{n.GROUP}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=n.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=n.GROUP, key="last-handled-configuration"
        )
        settings.posting.level = 20  # INFO and above become Kubernetes Events
        memo.client = kube.KubeClient(kube.login())

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        if getattr(memo, "client", None) is not None:
            await memo.client.close()

    kopf.on.login(registry=registry)(kube.login)

    # Change handlers return None: kopf would store a return value under status.<handler id>,
    # which the CRD's structural schema prunes.
    @kopf.on.create(*res, registry=registry)
    async def created(**kwargs: Any) -> None:
        await reconcile_object(config=config, **_pick(kwargs))

    @kopf.on.update(*res, registry=registry)
    async def updated(**kwargs: Any) -> None:
        await reconcile_object(config=config, **_pick(kwargs))

    @kopf.on.resume(*res, registry=registry)
    async def resumed(**kwargs: Any) -> None:
        await reconcile_object(config=config, **_pick(kwargs))

    @kopf.on.delete(*res, registry=registry)
    async def deleted(name: str, namespace: str | None, memo: Any, logger: Any, **_: Any) -> None:
        # Stop new traffic before the workers go; GC deletes the rest via owner references.
        client = _client(memo)
        assert namespace is not None, "LLMService is a namespaced resource"
        for api_version, kind, child in (
            ("networking.k8s.io/v1", "Ingress", name),
            ("v1", "Service", n.router_service_name(name)),
            ("apps/v1", "Deployment", n.deployment_name(name, "router")),
        ):
            if await client.delete(api_version, kind, namespace, child):
                logger.info(f"deleted {kind}/{child}")

    @kopf.timer(
        *res,
        registry=registry,
        interval=config.status_interval,
        initial_delay=config.status_interval,
    )
    async def observed(**kwargs: Any) -> None:
        await observe(**{k: kwargs[k] for k in ("body", "name", "namespace", "memo", "logger")})

    @kopf.timer(
        *res,
        registry=registry,
        interval=config.autoscale_tick,
        initial_delay=config.autoscale_tick,
        field="spec.autoscaling.enabled",
        value=True,
    )
    async def autoscaled(**kwargs: Any) -> None:
        memo = kwargs["memo"]
        await autoscaler.autoscale(
            **{k: kwargs[k] for k in ("body", "name", "namespace", "logger")}, memo=memo,
            client=_client(memo), lock=_lock(memo), settings=config.autoscale,
        )  # fmt: skip


_KEYS = ("body", "spec", "name", "namespace", "meta", "memo", "logger")


def _pick(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: kwargs[k] for k in _KEYS}
