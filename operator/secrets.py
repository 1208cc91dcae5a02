"""The per-LLMService shared secret (router ↔ workers), created once; rotated by hand
(docs/security.md: three edits of its ``accepted`` / ``secret`` entries, each rolled out).

Rendering is a pure function, so the random value cannot come from it: the change
handler creates ``<name>-secret`` (key ``secret``, owned by the LLMService) when it is
missing and leaves an existing one alone. Pods read it as ``PDSERVE_SERVICE_SECRET``.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

import kopf

from pdserve.operator import naming as n
from pdserve.operator.kube import KubeClient, KubeError
from pdserve.operator.reconcile import ForeignChild, controlled_by
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
    """Create the Secret if it does not exist; True if created. Never regenerates it."""
    name = n.service_secret_name(spec.name)
    live = await client.get("v1", "Secret", spec.namespace, name)
    uid = owner["metadata"]["uid"]
    if live is None:
        obj = secret_manifest(
            spec, secrets.token_urlsafe(32).encode(), secrets.token_urlsafe(32).encode()
        )
        kopf.adopt(obj, owner=owner)
        try:
            await client.create(obj)
            return True
        except KubeError as e:
            if e.status != 409:
                raise
            live = await client.get("v1", "Secret", spec.namespace, name)
    if live is not None and not controlled_by(live, uid):
        raise ForeignChild(f"Secret/{name}", live)
    return False
