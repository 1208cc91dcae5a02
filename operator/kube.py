"""A small async Kubernetes client for the operator's children (get/create/patch/delete).

kopf handles the LLMService itself; the children are plain REST calls made
with the same credentials kopf logs in with (``login`` below is also kopf's
login handler), so both always talk to the same API server as the same user.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

logger = logging.getLogger(__name__)

# (apiVersion, kind) -> plural, for every kind the operator reads or writes.
PLURALS: dict[tuple[str, str], str] = {
    ("discovery.k8s.io/v1", "EndpointSlice"): "endpointslices",  # router replicas (autoscaler)
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("pdserve.io/v1alpha1", "LLMService"): "llmservices",
    ("kopf.dev/v1", "KopfPeering"): "kopfpeerings",  # HA: the chart creates one per namespace
}
_SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
USER_AGENT = "pdserve-operator"  # audit logs (and bench/operator_load.py) tell our requests apart


class KubeError(Exception):
    def __init__(self, status: int, message: str, server_message: str = "") -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.server_message = server_message or message  # the API server's own words


def resource_path(api_version: str, kind: str, namespace: str, name: str = "") -> str:
    plural = PLURALS.get((api_version, kind))
    if plural is None:
        raise KeyError(f"unknown kind {api_version}/{kind}; known: {sorted(PLURALS)}")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def login(**_: Any) -> kopf.ConnectionInfo:
    """In-cluster service account, else the kubeconfig named by $KUBECONFIG (read at call time)."""
    if os.path.exists(f"{_SA_DIR}/token") and os.environ.get("KUBERNETES_SERVICE_HOST"):
        host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
        with open(f"{_SA_DIR}/token", encoding="utf-8") as f:
            token = f.read().strip()
        return kopf.ConnectionInfo(
            server=f"https://{host}:{port}",
            ca_path=f"{_SA_DIR}/ca.crt",
            scheme="Bearer",
            token=token,
        )
    import kubernetes.client
    import kubernetes.config

    cfg = kubernetes.client.Configuration()
    path = os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0]
    kubernetes.config.load_kube_config(
        config_file=os.path.expanduser(path), client_configuration=cfg
    )
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    scheme, _sep, token = str(header or "").partition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    ctx = ssl.create_default_context(cafile=info.ca_path)
    if info.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if info.certificate_path:
        ctx.load_cert_chain(info.certificate_path, info.private_key_path)
    return ctx


class KubeClient:
    """get/create/patch/delete of namespaced objects; ``None`` from ``get`` means 404."""

    def __init__(
        self, info: kopf.ConnectionInfo, login_fn: Any = None, refresh_s: float = 60.0
    ) -> None:
        # With ``login_fn`` the credentials follow kopf's: bound service-account tokens
        # expire (an hour by default) and the kubelet rewrites the token file, so the
        # client logs in again every ``refresh_s`` and once after a 401.
        self.login_fn, self.refresh_s = login_fn, refresh_s
        self.logins = 0
        self._open(info)

    def _open(self, info: kopf.ConnectionInfo) -> None:
        self.info = info
        self.logged_in_at = time.monotonic()
        self.logins += 1
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        auth = aiohttp.BasicAuth(info.username, info.password or "") if info.username else None
        connector = aiohttp.TCPConnector(ssl=_ssl_context(info))
        timeout = aiohttp.ClientTimeout(total=30)
        self.session = aiohttp.ClientSession(
            headers=headers, auth=auth, connector=connector, timeout=timeout
        )

    async def _relogin(self, force: bool) -> None:
        if self.login_fn is None:
            return
        if not force and time.monotonic() - self.logged_in_at < self.refresh_s:
            return
        info = self.login_fn()
        if info == self.info and not force:
            self.logged_in_at = time.monotonic()
            return
        old = self.session
        self._open(info)
        await old.close()

    async def close(self) -> None:
        await self.session.close()

    async def _call(self, method: str, path: str, body: Any = None, ctype: str = "") -> Any:
        await self._relogin(force=False)
        try:
            return await self._request(method, path, body, ctype)
        except KubeError as e:
            if e.status != 401 or self.login_fn is None:
                raise
        await self._relogin(force=True)  # the token expired before our refresh: once more
        return await self._request(method, path, body, ctype)

    async def _request(self, method: str, path: str, body: Any, ctype: str) -> Any:
        headers = {"Content-Type": ctype or "application/json"} if body is not None else {}
        url = self.info.server.rstrip("/") + path
        async with self.session.request(method, url, json=body, headers=headers) as resp:
            if resp.status == 404 and method == "GET":
                return None
            data = await resp.json(content_type=None) if resp.content_length != 0 else None
            if resp.status >= 400:
                message = data.get("message", "") if isinstance(data, dict) else str(data)
                raise KubeError(resp.status, f"{method} {path}: {message}", message)
            return data

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        result: dict | None = await self._call(
            "GET", resource_path(api_version, kind, namespace, name)
        )
        return result

    async def list(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Objects whose labels include ``labels`` (the selector is also re-checked here)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        path = resource_path(api_version, kind, namespace) + "?labelSelector=" + quote(selector)
        data = await self._call("GET", path)
        items = (data.get("items") or []) if isinstance(data, dict) else []
        want = set(labels.items())
        return [
            i for i in items if want <= set(((i.get("metadata") or {}).get("labels") or {}).items())
        ]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        result: dict[str, Any] = await self._call("POST", path, obj)
        return result

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict,
        *,
        status: bool = False,
    ) -> dict[str, Any]:
        path = resource_path(api_version, kind, namespace, name) + ("/status" if status else "")
        result: dict[str, Any] = await self._call(
            "PATCH", path, patch, "application/merge-patch+json"
        )
        return result

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any]:
        """Set ``spec.replicas`` through the ``/scale`` subresource (an autoscaling/v1 Scale),
        as an HPA or ``kubectl scale`` does: RBAC grants it apart from the object
        (``deployments/scale``), and the write touches no other field of the spec."""
        path = resource_path(api_version, kind, namespace, name) + "/scale"
        result: dict[str, Any] = await self._call(
            "PATCH", path, {"spec": {"replicas": replicas}}, "application/merge-patch+json"
        )
        return result

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete in the background (owners first, children by GC); False if it was already gone."""
        path = resource_path(api_version, kind, namespace, name)
        try:
            await self._call("DELETE", path, {"propagationPolicy": "Background"})
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True
