"""How many router replicas share the per-client budgets.

Rate limits (``--rate-limit-rpm/-tpm``) and ``--max-concurrency-per-key`` are budgets per
API key for the whole service. Replicas exchange no counters: each enforces its share,
``ceil(budget / replicas)`` (``--procs`` splits a replica's share again over its
processes), and a client's requests reach the replicas evenly (a Service, a round-robin
load balancer), so together they allow the budget. The count comes from
``--router-replicas N`` (local, fixed), or, in a cluster, from the ready endpoints of the
router's own Service's EndpointSlices (watched, like the worker pools: a replica that
starts or stops changes every replica's share within a watch event). The count never
drops below 1, so a lone replica enforces the whole budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdserve.router.config import RouterConfig
from pdserve.router.discovery.kube_api import ApiAccess, load_access
from pdserve.router.discovery.slice_watch import SliceWatch
from pdserve.router.discovery.tasks import stop_task

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
Listener = Callable[[int], None]


def share(budget: int, parts: int) -> int:
    """One part of a per-client budget split ``parts`` ways, rounded up so that a budget
    smaller than the count still admits one (0: no limit)."""
    return -(-budget // max(parts, 1)) if budget > 0 else 0


class ReplicaCount:
    """A fixed count (``--router-replicas``); the base of the watched one."""

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = max(replicas, 1)
        self._listeners: list[Listener] = []
        self._address_listeners: list[Callable[[list[str]], None]] = []

    def listen(self, fn: Listener) -> None:
        """Call ``fn(replicas)`` now and on every change."""
        self._listeners.append(fn)
        fn(self.replicas)

    def listen_addresses(self, fn: Callable[[list[str]], None]) -> None:
        """Call ``fn(addresses)`` on every change of the ready replicas' addresses (a
        watched count only: router/peer_budgets.py's kubernetes peers)."""
        self._address_listeners.append(fn)

    def set(self, replicas: int) -> None:
        replicas = max(replicas, 1)
        if replicas == self.replicas:
            return
        log.info("router replicas: %d -> %d; per-client budgets re-split", self.replicas, replicas)
        self.replicas = replicas
        for fn in self._listeners:
            fn(replicas)

    async def start(self) -> None:
        """Begin following the count (nothing to follow for a fixed one)."""

    async def close(self) -> None:
        """Stop following it."""


def ready_endpoints(slices: Iterable[Mapping[str, Any]]) -> int:
    """Distinct ready, not terminating, addresses in a Service's slices."""
    return len(ready_addresses(slices))


def ready_addresses(slices: Iterable[Mapping[str, Any]]) -> list[str]:
    """The ready, not terminating, addresses in a Service's slices, sorted."""
    seen: set[str] = set()
    for s in slices:
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            addresses = ep.get("addresses") or []
            if addresses and cond.get("ready") is not False and not cond.get("terminating"):
                seen.add(addresses[0])
    return sorted(seen)


class ServiceReplicaCount(ReplicaCount):
    """The ready endpoints of the router's own Service (a watch of its EndpointSlices)."""

    def __init__(
        self,
        service: str,
        namespace: str,
        access: Callable[[], ApiAccess] = load_access,
        replicas: int = 1,
    ) -> None:
        super().__init__(replicas)
        self.service = service
        selector = f"{SERVICE_NAME_LABEL}={service}"
        self.watch = SliceWatch(access, namespace, selector, self._changed)
        self._task: asyncio.Task[None] | None = None

    def _changed(self) -> None:
        # A replica not ready yet (starting, catching up) is not in the count: its share is
        # the others' until it is (a client's requests do not reach it meanwhile either).
        addresses = ready_addresses(self.watch.slices.values())
        self.set(len(addresses))
        for fn in self._address_listeners:
            fn(addresses)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.watch.run())

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None


def replica_count(cfg: RouterConfig) -> ReplicaCount:
    """What ``cfg`` says: the router Service's ready endpoints, else a fixed count."""
    if not cfg.router_service:
        return ReplicaCount(cfg.router_replicas)
    from pdserve.router.discovery.k8s import current_namespace

    namespace = cfg.router_namespace or current_namespace()
    return ServiceReplicaCount(cfg.router_service, namespace, replicas=cfg.router_replicas)
