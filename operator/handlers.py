"""kopf handlers for LLMService: one per cause, registered on a given registry.

create / update / resume → ``reconcile``: parse, preflight, render, adopt, apply.
watch events on the LLMService and its children → ``cache`` + ``sync`` (drift repair,
status), no polling. No delete handler and no timers, so no finalizer: deletion is
owner-reference garbage collection, and ``helm uninstall`` never leaves an object stuck.
autoscaler loop (objects with spec.autoscaling.enabled) → ``autoscaler.autoscale``.
"""

from __future__ import annotations

import asyncio
import logging
import types
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from pdserve.operator import autoscaler, kube, preflight, reconcile, render, secrets, sync
from pdserve.operator import naming as n
from pdserve.operator import status as st
from pdserve.operator import transfer_health as th
from pdserve.operator.cache import WATCHED, Cache
from pdserve.operator.pod_policy import PodPolicy, check_service
from pdserve.operator.spec import LLMServiceSpec, SpecError
from pdserve.operator.spec_parse import parse_llmservice


@dataclass(frozen=True)
class OperatorConfig:
    status_interval: float = 60.0  # resync from the cache (a safety net for lost events)
    retry_delay: float = 30.0  # TemporaryError delay when a referenced object is missing
    autoscale_tick: float = 5.0  # autoscaler loop period; each object plans every intervalSeconds
    debounce: float = 0.2  # a burst of watch events on one object becomes one sync
    default_image: str = ""  # for LLMServices without spec.image ("": render.DEFAULT_IMAGE)
    peering_lifetime: int = 15  # seconds a silent active replica blocks the standbys
    # KV-transfer fallback check (transfer_health): period (0: off), share, floor, and a
    # /metrics URL template ({service}, {namespace}) instead of the decode pods' DNS.
    transfer_check_interval: float = 60.0
    transfer_failure_share: float = 0.05
    transfer_min_failures: int = 5
    decode_metrics_url: str = ""
    autoscale: autoscaler.AutoscaleSettings = field(default_factory=autoscaler.AutoscaleSettings)
    # What an LLMService may put into its pods (pod_policy.py): the allowlist unless a
    # cluster admin opts out (--allow-unsafe-pod-fields).
    pod_policy: PodPolicy = field(default_factory=PodPolicy)


def _client(memo: Any) -> kube.KubeClient:
    client = getattr(memo, "client", None)
    assert client is not None, "the startup handler creates the client before any resource handler"
    return client


def _lock(memo: Any, namespace: str, name: str) -> asyncio.Lock:
    # One lock per LLMService, shared by the change handlers, the watch-driven sync and the
    # autoscaler: they must not apply children or write conditions concurrently.
    syncer: sync.Syncer = memo.syncer
    return syncer.lock((namespace, name))


def _parse(name: str, namespace: str, spec: Any, policy: PodPolicy) -> LLMServiceSpec:
    svc = parse_llmservice({"metadata": {"name": name, "namespace": namespace}, "spec": dict(spec)})
    check_service(svc, policy)
    return svc


async def _degrade(
    memo: Any,
    namespace: str,
    name: str,
    message: str,
    generation: int | None,
    reason: str = st.REASON_INVALID_SPEC,
) -> None:
    client = _client(memo)
    fresh = await client.get(n.API_VERSION, n.KIND, namespace, name)
    old = ((fresh or {}).get("status") or {}).get("conditions") or []
    new = [st.condition("Degraded", True, reason, message, generation)]
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in old):
        new.append(st.condition("Ready", False, reason, message, generation))
    await sync.write_status(client, memo.cache, fresh, new, {})


async def _apply(
    memo: Any, body: Any, svc: LLMServiceSpec, default_image: str
) -> reconcile.ApplyResult:
    client, cache = _client(memo), memo.cache
    await secrets.ensure_service_secret(client, svc, body)
    children = render.render_spec(svc, default_image)
    kopf.adopt(children, owner=body)

    async def cached(c: Any) -> dict[str, Any] | None:
        return cache.child(svc.namespace, c["kind"], c["metadata"]["name"])

    return await reconcile.apply_children(client, svc, children, cached)


async def reconcile_object(
    *,
    body: Any,
    spec: Any,
    name: str,
    namespace: str,
    meta: Any,
    memo: Any,
    config: OperatorConfig,
    logger: Any,
) -> reconcile.ApplyResult:
    generation = meta.get("generation")
    client = _client(memo)
    async with _lock(memo, namespace, name):
        try:
            svc = _parse(name, namespace, spec, config.pod_policy)
        except SpecError as e:
            await _degrade(memo, namespace, name, str(e), generation)
            raise kopf.PermanentError(f"invalid spec: {e}") from e  # only an edit can fix it
        problems = await preflight.preflight(client, svc)
        if problems:
            message = "; ".join(str(p) for p in problems)
            await _degrade(memo, namespace, name, message, generation)
            if all(p.retryable for p in problems):  # e.g. the Secret is created right after us
                raise kopf.TemporaryError(message, delay=config.retry_delay)
            raise kopf.PermanentError(message)
        try:
            result = await _apply(memo, body, svc, config.default_image)
        except reconcile.ForeignChild as e:  # its owner may delete it: retry
            await _degrade(memo, namespace, name, str(e), generation, st.REASON_FOREIGN_CHILD)
            raise kopf.TemporaryError(str(e), delay=config.retry_delay) from e
        except reconcile.ChildRejected as e:  # the same spec renders the same child
            await _degrade(memo, namespace, name, str(e), generation, st.REASON_CHILD_REJECTED)
            raise kopf.PermanentError(str(e)) from e
        keep = {reconcile.key_of(c) for c in render.render_spec(svc)}
        optional = render.optional_children(name)
        pruned = await reconcile.prune_children(client, namespace, meta["uid"], optional, keep)
        fresh = await client.get(n.API_VERSION, n.KIND, namespace, name)
        ok = st.condition("Degraded", False, "AsExpected", "spec applied", generation)
        await sync.write_status(client, memo.cache, fresh, [ok], {"observedGeneration": generation})
    done = {"created": result.created, "patched": result.patched, "pruned": pruned}
    message = f"applied: {', '.join(f'{k}={list(v)}' for k, v in done.items())}"
    logger.info(message)
    if result.created or result.patched or pruned:
        kopf.event(body, type="Normal", reason="Applied", message=message)
    return result


async def autoscale_forever(memo: Any, config: OperatorConfig) -> None:
    """One autoscaler task per LLMService with autoscaling on (what a kopf timer was, without
    the finalizer a timer needs); a task ends when its object goes or turns autoscaling off."""
    tasks: dict[Any, asyncio.Task[None]] = {}
    try:
        while True:
            for key, body in list(memo.cache.services.items()):
                on = ((body.get("spec") or {}).get("autoscaling") or {}).get("enabled")
                if on and (key not in tasks or tasks[key].done()):
                    tasks[key] = asyncio.create_task(_autoscale_one(memo, config, key))
            await asyncio.sleep(config.autoscale_tick)
    finally:
        for task in tasks.values():
            task.cancel()


async def _autoscale_one(memo: Any, config: OperatorConfig, key: Any) -> None:
    logger = logging.getLogger("pdserve.operator.autoscaler")
    own_memo = types.SimpleNamespace()  # the planner's state between intervals
    while True:
        body = memo.cache.services.get(key)
        if not body or not ((body.get("spec") or {}).get("autoscaling") or {}).get("enabled"):
            return
        try:
            await autoscaler.autoscale(
                body=body,
                name=key[1],
                namespace=key[0],
                logger=logger,
                memo=own_memo,
                client=_client(memo),
                lock=_lock(memo, *key),
                settings=config.autoscale,
                cached=memo.cache.child,
            )
        except Exception as e:  # one interval's failure must not stop the next
            logger.warning(f"autoscaler: {key[0]}/{key[1]}: {e!r}")
        await asyncio.sleep(config.autoscale_tick)


async def transfer_health_forever(memo: Any, config: OperatorConfig) -> None:
    """Every interval, a Warning Event on each LLMService whose decode pods recompute often."""
    logger = logging.getLogger("pdserve.operator.transfer_health")
    previous: dict[Any, th.Counts] = {}
    async with aiohttp.ClientSession() as session:
        while True:
            await asyncio.sleep(config.transfer_check_interval)
            try:
                await _check_transfers(memo, config, session, previous, logger)
            except Exception as e:  # one bad scrape must not end the loop
                logger.warning(f"KV transfer check failed: {e!r}")


async def _check_transfers(
    memo: Any,
    config: OperatorConfig,
    session: aiohttp.ClientSession,
    previous: dict[Any, th.Counts],
    logger: Any,
) -> None:
    for key, body in list(memo.cache.services.items()):
        if ((body.get("spec") or {}).get("kvTransfer") or {}).get("transport") == "tcp":
            continue
        if config.decode_metrics_url:
            urls = [config.decode_metrics_url.format(service=key[1], namespace=key[0])]
        else:
            urls = await th.decode_urls(key[1], key[0])()
        now = await th.scrape(session, urls)
        before, previous[key] = previous.get(key), now
        message = (
            th.assess(now - before, config.transfer_failure_share, config.transfer_min_failures)
            if before
            else ""
        )
        if message:
            logger.warning(f"{key[0]}/{key[1]}: {message}")
            kopf.warn(body, reason="KVTransferFallback", message=message)


def _skip_watch_handler_events(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if "Handler 'watch-" in message or "service_event" in message:
        record.k8s_skip = True  # kopf's poster skips records marked so
    return True


def register(registry: kopf.OperatorRegistry, config: OperatorConfig = OperatorConfig()) -> None:
    """Register all LLMService handlers on ``registry`` (kopf's default one for ``kopf run``)."""
    res = (n.GROUP, n.VERSION, n.PLURAL)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=n.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=n.GROUP, key="last-handled-configuration"
        )
        settings.posting.level = logging.INFO  # INFO and above become Kubernetes Events
        # ... except kopf's "Handler succeeded" for the watch-event handlers: one Event (an
        # API request) per watch event would undo the point of watching.
        logging.getLogger("kopf.objects").addFilter(_skip_watch_handler_events)
        # A standby takes over when the active replica's peering record expires (a crash) or
        # is removed (a clean stop, at once): 15 s rather than kopf's 60.
        settings.peering.lifetime = config.peering_lifetime
        # No cluster scan: kopf lists and watches every Namespace (and CRD) to resolve its
        # namespaces, which the namespaced chart does not grant; on a real API server it
        # retried the 403 nine times (~1 min, ERROR logs) before it fell back to the named
        # namespaces (tests/k8s_real). The chart installs the CRDs before the operator.
        settings.scanning.disabled = True
        memo.client = kube.KubeClient(kube.login(), login_fn=kube.login)
        memo.cache = Cache()
        memo.syncer = sync.Syncer(
            memo.client, memo.cache, config.debounce, config.default_image, config.pod_policy
        )
        memo.loops = []

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: Any, **_: Any) -> None:
        for task in getattr(memo, "loops", []):
            task.cancel()
        if getattr(memo, "syncer", None) is not None:
            await memo.syncer.close()
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

    @kopf.on.event(*res, registry=registry)
    async def service_event(event: Any, body: Any, memo: Any, **_: Any) -> None:
        if not memo.loops:  # started here, not at startup: kopf.info() needs a resource context
            memo.loops += [
                asyncio.create_task(memo.syncer.resync_forever(config.status_interval)),
                asyncio.create_task(autoscale_forever(memo, config)),
            ]
            if config.transfer_check_interval > 0:
                memo.loops.append(asyncio.create_task(transfer_health_forever(memo, config)))
        key = memo.cache.put_service(body, deleted=event.get("type") == "DELETED")
        if event.get("type") != "DELETED":
            memo.syncer.poke(key)

    async def child_event(event: Any, body: Any, memo: Any, **_: Any) -> None:
        owner = memo.cache.put_child(body, deleted=event.get("type") == "DELETED")
        if owner is not None and owner in memo.cache.services:
            memo.syncer.poke(owner)

    managed = {"app.kubernetes.io/managed-by": n.MANAGED_BY}
    for w in WATCHED:
        kopf.on.event(
            w.group, w.version, w.plural, labels=managed, registry=registry, id=f"watch-{w.plural}"
        )(child_event)


_KEYS = ("body", "spec", "name", "namespace", "meta", "memo", "logger")


def _pick(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: kwargs[k] for k in _KEYS}
