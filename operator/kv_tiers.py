"""``spec.kvCache.tiers``: the KV tiers below the workers' pools (docs/kv_tiers.md).

Parsed into ``KVTiersSpec``, rendered as every worker's ``--kv-tier-*`` flags (prefill and
decode pods alike: a decode worker's prefix cache evicts as well), a disk
volume (an ``emptyDir`` bounded by ``diskBytes``, or the volume source given) mounted at
``diskPath``, and, for the shared tier, either an existing store's address or a
Deployment + Service of the Redis image that the operator runs itself (memory-bounded,
LRU, no persistence: it is a cache). The store's password comes from a Secret
(``shared.passwordSecret``; required for a store the operator runs): the workers read it
as ``PDSERVE_KV_SHARED_PASSWORD``, the server as ``--requirepass``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.operator import naming as n

DEFAULT_IMAGE = "redis:7.2-alpine"
STORE_PORT = 6379
PASSWORD_ENV = "PDSERVE_KV_SHARED_PASSWORD"  # engine/kv_tiers/config.py SHARED_PASSWORD_ENV


@dataclass(frozen=True)
class KVTiersSpec:
    host_bytes: int = 0
    host_compress: bool = False
    disk_bytes: int = 0  # 0: no disk tier
    disk_path: str = "/var/cache/pdserve-kv"
    disk_volume: Mapping[str, Any] = field(default_factory=dict)  # a volume source; {}: emptyDir
    shared: bool = False
    shared_address: str = ""  # host:port of an existing store; "": the operator runs one
    password_secret: str = ""
    password_key: str = "password"
    store_image: str = DEFAULT_IMAGE
    store_max_memory: str = "1gb"
    load_timeout_seconds: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_bytes > 0 or self.shared


def parse_kv_tiers(r: Any) -> KVTiersSpec:
    """``r``: spec_parse's reader of ``spec.kvCache.tiers``."""
    from pdserve.operator.spec import SpecError  # spec.py imports this module's spec class

    shared, secret = r.sub("shared"), r.sub("shared").sub("passwordSecret")
    spec = KVTiersSpec(
        host_bytes=r.number("hostBytes", 0, minimum=0),
        host_compress=r.get("hostCompress", bool, False),
        disk_bytes=r.number("diskBytes", 0, minimum=0),
        disk_path=r.get("diskPath", str, KVTiersSpec.disk_path),
        disk_volume=r.get("diskVolume", Mapping, {}),
        shared=shared.get("enabled", bool, False),
        shared_address=shared.get("address", str, ""),
        password_secret=secret.get("name", str, ""),
        password_key=secret.get("key", str, "password"),
        store_image=shared.get("image", str, DEFAULT_IMAGE),
        store_max_memory=shared.get("maxMemory", str, "1gb"),
        load_timeout_seconds=r.number("loadTimeoutSeconds", 1.0, minimum=0.001),
    )
    if not spec.disk_path.startswith("/"):
        raise SpecError(f"{r.path}.diskPath", f"must be an absolute path, got {spec.disk_path!r}")
    if spec.shared and not spec.shared_address and not spec.password_secret:
        msg = "is required when the operator runs the shared store (no shared.address)"
        raise SpecError(f"{shared.path}.passwordSecret.name", msg + ": KV blocks are prompt data")
    return spec


def store_name(service: str) -> str:
    return f"{service}-kv-store"


def store_url(spec: Any) -> str:
    t: KVTiersSpec = spec.kv_tiers
    address = t.shared_address or f"{store_name(spec.name)}.{spec.namespace}.svc:{STORE_PORT}"
    return f"redis://{address}/0"


def worker_args(spec: Any, role: str) -> list[str]:
    """A worker's tier flags (``role``: prefill or decode, the same tiers)."""
    t: KVTiersSpec = spec.kv_tiers
    if not t.enabled:
        return []
    args = ["--kv-tier-load-timeout", str(t.load_timeout_seconds)]
    if t.host_bytes:
        args += ["--kv-tier-host-bytes", str(t.host_bytes)]
        args += ["--kv-tier-host-compress"] if t.host_compress else []
    if t.disk_bytes:
        args += ["--kv-tier-disk-path", t.disk_path, "--kv-tier-disk-bytes", str(t.disk_bytes)]
    if t.shared:
        args += ["--kv-tier-shared-url", store_url(spec)]
    return args


def add_to_pod(spec: Any, role: str, pod: dict[str, Any]) -> None:
    """The disk tier's volume and the store's password, in a worker's pod."""
    t: KVTiersSpec = spec.kv_tiers
    if not t.enabled:
        return
    container = pod["containers"][0]
    if t.disk_bytes:
        source = dict(t.disk_volume) or {"emptyDir": {"sizeLimit": str(t.disk_bytes)}}
        pod["volumes"].append({"name": "kv-tier-disk", **source})
        container.setdefault("volumeMounts", []).append(
            {"name": "kv-tier-disk", "mountPath": t.disk_path}
        )
    if t.shared and t.password_secret:
        container.setdefault("env", []).append(_password_env(t))


def _password_env(t: KVTiersSpec) -> dict[str, Any]:
    ref = {"name": t.password_secret, "key": t.password_key}
    return {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": ref}}


def store_children(spec: Any) -> list[dict[str, Any]]:
    """The shared store the operator runs (none for an existing ``shared.address``)."""
    t: KVTiersSpec = spec.kv_tiers
    if not t.shared or t.shared_address:
        return []
    name, labels = store_name(spec.name), n.labels(spec.name, "kv-store")
    meta = {"name": name, "namespace": spec.namespace, "labels": labels}
    args = [
        "--port",
        str(STORE_PORT),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        t.store_max_memory,
        "--maxmemory-policy",
        "allkeys-lru",
        "--requirepass",
        f"$({PASSWORD_ENV})",
    ]
    container = {
        "name": "redis",
        "image": t.store_image,
        "args": args,
        "env": [_password_env(t)],
        "ports": [{"name": "redis", "containerPort": STORE_PORT, "protocol": "TCP"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "runAsUser": 999,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = {
        "containers": [container],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "automountServiceAccountToken": False,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }
    selector = n.selector(spec.name, "kv-store")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": dict(meta),
        "spec": {
            "selector": selector,
            "ports": [
                {"name": "redis", "port": STORE_PORT, "targetPort": "redis", "protocol": "TCP"}
            ],
        },
    }
    return [service, deployment]


def optional_children(service: str) -> list[tuple[str, str, str]]:
    return [("apps/v1", "Deployment", store_name(service)), ("v1", "Service", store_name(service))]
