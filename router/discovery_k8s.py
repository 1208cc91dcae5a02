"""Kubernetes endpoint source: ready pods of one LLMService by label.

Pods carry ``pdserve.io/service=<name>`` and ``pdserve.io/role=prefill|decode``
(docs/architecture.md); every worker container listens on HTTP 8080. Uses the
official ``kubernetes`` client with in-cluster config (or kubeconfig outside a
cluster); its blocking calls run in a thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve.router.discovery import Endpoint, EndpointSource

SERVICE_LABEL = "pdserve.io/service"
ROLE_LABEL = "pdserve.io/role"
WORKER_PORT = 8080


NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def current_namespace() -> str:
    """The pod's own namespace in a cluster, else ``default``."""
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def load_core_api() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api()


def pod_is_ready(pod: Any) -> bool:
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return False
    if pod.metadata.deletion_timestamp is not None:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def endpoints_from_pods(pods: list[Any], port: int = WORKER_PORT) -> list[Endpoint]:
    out = []
    for pod in pods:
        role = (pod.metadata.labels or {}).get(ROLE_LABEL)
        if role in ("prefill", "decode") and pod_is_ready(pod):
            out.append(Endpoint(f"http://{pod.status.pod_ip}:{port}", role))
    return sorted(out, key=lambda e: (e.role, e.url))


class KubernetesSource(EndpointSource):
    def __init__(
        self, service: str, namespace: str, port: int = WORKER_PORT, core_api: Any = None
    ) -> None:
        if not service:
            raise ValueError("--discovery kubernetes needs --service NAME")
        self.service = service
        self.namespace = namespace
        self.port = port
        self._api = core_api

    @property
    def selector(self) -> str:
        return f"{SERVICE_LABEL}={self.service},{ROLE_LABEL} in (prefill,decode)"

    def _list_sync(self) -> list[Endpoint]:
        if self._api is None:
            self._api = load_core_api()
        pods = self._api.list_namespaced_pod(self.namespace, label_selector=self.selector)
        return endpoints_from_pods(list(pods.items), self.port)

    async def list(self) -> list[Endpoint]:
        return await asyncio.to_thread(self._list_sync)
