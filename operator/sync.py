"""Watch-driven sync of one LLMService: drift repair and status, from the cache only.

A watch event on the LLMService or any of its children pokes ``Syncer``; after a short
debounce (a rollout is a burst of Deployment events) one sync runs under the object's
lock: re-apply the rendering where the cached child differs, then write the status when
it changed. Nothing is read from the API server, so an idle fleet costs no requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf

from pdserve.operator import naming as n
from pdserve.operator import reconcile, render
from pdserve.operator import status as st
from pdserve.operator.cache import WATCHED_KINDS, Cache, Key
from pdserve.operator.kube import KubeClient
from pdserve.operator.pod_policy import PodPolicy, check_service
from pdserve.operator.spec import SpecError
from pdserve.operator.spec_parse import parse_llmservice

logger = logging.getLogger(__name__)


async def write_status(
    client: KubeClient,
    cache: Cache,
    fresh: Mapping[str, Any] | None,
    conditions: list[dict[str, Any]],
    extra: Mapping[str, Any],
) -> None:
    """Merge ``conditions`` into ``fresh``'s status and patch it (call under the object's lock).

    Conditions are a list that a merge patch replaces whole: every writer holds the one
    per-object lock and puts the patched object back into the cache, so the next writer
    merges into the newest conditions, never a stale copy.
    """
    if fresh is None:
        return
    meta = fresh["metadata"]
    old = (fresh.get("status") or {}).get("conditions") or []
    new = {"conditions": st.merge_conditions(list(old), conditions), **extra}
    if not reconcile.contains(fresh.get("status") or {}, new):
        patch = {"status": new}
        out = await client.patch(
            n.API_VERSION, n.KIND, meta["namespace"], meta["name"], patch, status=True
        )
        if isinstance(out, dict) and out.get("metadata"):
            cache.put_service(out)


def handler_owns_degraded(status: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Degraded"
        and c.get("status") == "True"
        and c.get("reason") in st.HANDLER_REASONS
        for c in status.get("conditions") or []
    )


async def sync_service(
    client: KubeClient,
    cache: Cache,
    key: Key,
    default_image: str = "",
    policy: PodPolicy | None = None,
) -> None:
    body = cache.services.get(key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    namespace, name = key
    try:
        svc = parse_llmservice(body, namespace)
        check_service(svc, policy or PodPolicy())  # never repair towards a refused pod
    except SpecError:
        return  # Degraded is already reported by the change handler
    status = body.get("status") or {}
    applied = status.get("observedGeneration") == body["metadata"].get("generation")
    if applied and not handler_owns_degraded(status):
        # Drift repair covers the watched kinds (an optional HTTPRoute is applied on change only:
        # the Gateway API CRDs may not exist, and it is not in the cache).
        children = [c for c in render.render_spec(svc, default_image) if c["kind"] in WATCHED_KINDS]
        kopf.adopt(children, owner=cast(kopf.Body, body))  # the raw watched body

        async def cached(c: Mapping[str, Any]) -> dict[str, Any] | None:
            return cache.child(namespace, c["kind"], c["metadata"]["name"])

        try:
            result = await reconcile.apply_children(client, svc, children, cached)
        except (reconcile.ForeignChild, reconcile.ChildRejected) as e:
            logger.warning(f"{namespace}/{name}: not repairing drift: {e}")
        else:
            if result.patched or result.created:
                logger.info(
                    f"{namespace}/{name}: reverted drift: "
                    f"{list(result.created) + list(result.patched)}"
                )
    deployments = {
        role: cache.child(namespace, "Deployment", n.deployment_name(name, role))
        for role in n.ROLES
    }
    new = st.observed_status(
        svc, status.get("observedGeneration"), deployments, status.get("conditions") or []
    )
    conditions = new.pop("conditions")
    await write_status(client, cache, cache.services.get(key), conditions, new)


class Syncer:
    """Debounced, per-object-serialised ``sync_service`` runs."""

    def __init__(
        self,
        client: KubeClient,
        cache: Cache,
        debounce: float = 0.2,
        default_image: str = "",
        policy: PodPolicy | None = None,
    ) -> None:
        self.client, self.cache, self.debounce = client, cache, debounce
        self.default_image = default_image
        self.policy = policy
        self.locks: dict[Key, asyncio.Lock] = {}
        self.pending: set[Key] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def poke(self, key: Key) -> None:
        if key in self.pending:
            return  # a sync is already scheduled; it will see this change too
        self.pending.add(key)
        task = asyncio.create_task(self._run(key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, key: Key) -> None:
        await asyncio.sleep(self.debounce)
        self.pending.discard(key)
        try:
            async with self.lock(key):
                await sync_service(self.client, self.cache, key, self.default_image, self.policy)
        except Exception as e:
            logger.warning(f"sync of {key[0]}/{key[1]} failed: {e!r}")

    async def resync_forever(self, interval: float) -> None:
        """A safety net for lost events; from the cache, so it costs no requests when idle."""
        while True:
            await asyncio.sleep(interval)
            for key in list(self.cache.services):
                self.poke(key)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
