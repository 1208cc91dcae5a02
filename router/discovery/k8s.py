"""Kubernetes endpoint source: the EndpointSlices of an LLMService's two pool Services.

The operator renders one headless Service per pool (``<name>-prefill``, ``<name>-decode``,
``operator/naming.py``); the EndpointSlice controller keeps their slices, labelled
``kubernetes.io/service-name``, in step with the pods. The router watches them
(``slice_watch.py``: no polling) and routes to an endpoint only while its conditions say
so: ``ready`` (nil counts as ready, as the API documents) and not ``terminating``. A
terminating decode pod therefore gets no new request the moment its pod starts to stop,
while the streams it already serves run on (they hold their own connections; the pod's
preStop pause and grace period let them finish, ``operator/render_deployments.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdserve.operator import naming
from pdserve.router.discovery.kube_api import ApiAccess, load_access
from pdserve.router.discovery.slice_watch import SliceWatch
from pdserve.router.discovery.tasks import stop_task
from pdserve.router.discovery.workers import Endpoint, EndpointSource

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WORKER_PORT = naming.HTTP_PORT
PORT_NAME = "http"
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def current_namespace() -> str:
    """The pod's own namespace in a cluster, else ``default``."""
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def pool_roles(service: str) -> dict[str, str]:
    """Pool Service name -> role, for one LLMService."""
    return {naming.pool_service_name(service, role): role for role in naming.POOL_ROLES}


def routable(endpoint: Mapping[str, Any]) -> bool:
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False and not conditions.get("terminating")


def _port(slice_: Mapping[str, Any], default: int) -> int:
    for p in slice_.get("ports") or []:
        if p.get("name") == PORT_NAME and p.get("port"):
            return int(p["port"])
    return default


def endpoints_from_slices(
    slices: Iterable[Mapping[str, Any]], roles: Mapping[str, str], default_port: int = WORKER_PORT
) -> list[Endpoint]:
    """The routable workers in ``slices``; a pod listed by two slices (mid-rebalance) once."""
    out: set[Endpoint] = set()
    for s in slices:
        labels = (s.get("metadata") or {}).get("labels") or {}
        role = roles.get(str(labels.get(SERVICE_NAME_LABEL, "")))
        if role is None:
            continue
        port, ipv6 = _port(s, default_port), s.get("addressType") == "IPv6"
        for ep in s.get("endpoints") or []:
            addresses = ep.get("addresses") or []
            if addresses and routable(ep):
                host = f"[{addresses[0]}]" if ipv6 else addresses[0]
                out.add(Endpoint(f"http://{host}:{port}", role))
    return sorted(out, key=lambda e: (e.role, e.url))


class KubernetesSource(EndpointSource):
    def __init__(
        self,
        service: str,
        namespace: str,
        port: int = WORKER_PORT,
        access: Callable[[], ApiAccess] = load_access,
        watch_timeout_s: float = 300.0,
        backoff_s: tuple[float, float] = (0.5, 30.0),
        first_sync_s: float = 5.0,
    ) -> None:
        if not service:
            raise ValueError("--discovery kubernetes needs --service NAME")
        self.service, self.namespace, self.port = service, namespace, port
        self.roles = pool_roles(service)
        self.first_sync_s = first_sync_s
        self._changed = asyncio.Event()
        self.watch = SliceWatch(
            access, namespace, self.selector, self._changed.set, watch_timeout_s, backoff_s
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def selector(self) -> str:
        return f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self.roles))})"

    async def list(self) -> list[Endpoint]:
        """The watched state; no API request (the first call starts the watch and waits a
        little for its LIST, so that the router's first health round has workers)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.watch.run())
        if not self.watch.synced.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.watch.synced.wait(), self.first_sync_s)
        return endpoints_from_slices(self.watch.slices.values(), self.roles, self.port)

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
