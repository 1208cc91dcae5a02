"""The per-LLMService shared secret (router ↔ workers), created once; rotated by hand
(docs/security.md: three edits of its ``accepted`` / ``secret`` entries, each rolled out).

Rendering is a pure function, so the random value cannot come from it: the change
handler creates ``<name>-secret`` (key ``secret``, owned by the LLMService) and leaves an
existing one alone (the create answers 409). Pods read it as ``PDSERVE_SERVICE_SECRET``.

The operator never reads a Secret (its RBAC grants ``create`` alone: a compromised
operator cannot read the Secrets pods reference; issue 44 item 12), so it cannot check
who owns an existing ``<name>-secret``: whoever may create Secrets in the namespace may
also mount them, and the namespace is the trust boundary (docs/security.md).
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

import kopf

from pdserve.operator import naming as n
from pdserve.operator.kube import KubeClient, KubeError
from pdserve.operator.spec import LLMServiceSpec


def secret_manifest(spec: LLMServiceSpec, value: bytes, hash_key: bytes = b"") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": n.service_secret_name(spec.name),
            "namespace": spec.namespace,
            "labels": n.labels(spec.name),
        },
        "data": {
            n.SECRET_KEY: base64.b64encode(value).decode(),
            **({n.HASH_KEY_KEY: base64.b64encode(hash_key).decode()} if hash_key else {}),
        },
    }


async def ensure_service_secret(client: KubeClient, spec: LLMServiceSpec, owner: Any) -> bool:
    """Create the Secret unless it exists (409); True if created. Never regenerates it,
    never reads it: one create per reconcile, where there was one get (a Secret deleted by
    hand comes back at the next)."""
    obj = secret_manifest(
        spec, secrets.token_urlsafe(32).encode(), secrets.token_urlsafe(32).encode()
    )
    kopf.adopt(obj, owner=owner)
    try:
        await client.create(obj)
    except KubeError as e:
        if e.status != 409:
            raise
        return False
    return True
