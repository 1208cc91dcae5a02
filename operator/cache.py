"""What the operator knows of the cluster, fed by watches (kopf event handlers), never by GETs.

Steady state costs no API requests: kopf keeps one watch per kind open, each event
updates this cache and pokes the owning LLMService's sync (``sync.py``), which
compares the rendering with the cached children and writes only what differs.

Children are keyed ``(namespace, "Kind/name")`` so that any object with our
label is found by the name the rendering gives it, whoever owns it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.operator import naming as n

Key = tuple[str, str]  # (namespace, name) of an LLMService


@dataclass(frozen=True)
class Watched:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


# Every kind of child the operator renders, except Secrets: watching Secrets would need
# list/watch on every Secret in the namespace; the service secret is only created once.
WATCHED = (
    Watched("", "v1", "serviceaccounts", "ServiceAccount"),
    Watched("", "v1", "configmaps", "ConfigMap"),
    Watched("", "v1", "services", "Service"),
    Watched("apps", "v1", "deployments", "Deployment"),
    Watched("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Watched("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Watched("networking.k8s.io", "v1", "ingresses", "Ingress"),
    Watched("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    Watched("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
)


WATCHED_KINDS = frozenset(w.kind for w in WATCHED)


def _newer(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """False when ``new`` is an older resourceVersion than ``old`` (a late watch event).

    resourceVersions are opaque, but every API server (etcd) issues increasing integers;
    anything else is taken as newer.
    """
    a = str(((old or {}).get("metadata") or {}).get("resourceVersion") or "")
    b = str((new.get("metadata") or {}).get("resourceVersion") or "")
    return not (a.isdigit() and b.isdigit() and int(b) < int(a))


@dataclass
class Cache:
    services: dict[Key, dict[str, Any]] = field(default_factory=dict)
    children: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def put_service(self, body: Mapping[str, Any], deleted: bool = False) -> Key:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if deleted:
            self.services.pop(key, None)
        elif _newer(self.services.get(key), body):
            self.services[key] = dict(body)
        return key

    def put_child(self, body: Mapping[str, Any], deleted: bool = False) -> Key | None:
        """Store one child; returns the LLMService it belongs to (by label), if any."""
        meta = body["metadata"]
        ckey = (meta["namespace"], f"{body['kind']}/{meta['name']}")
        if deleted:
            self.children.pop(ckey, None)
        elif _newer(self.children.get(ckey), body):
            self.children[ckey] = dict(body)
        owner = (meta.get("labels") or {}).get(n.LABEL_SERVICE)
        return (meta["namespace"], owner) if owner else None

    def child(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        return self.children.get((namespace, f"{kind}/{name}"))
