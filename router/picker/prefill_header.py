"""The prefill worker the endpoint picker chose, carried to the decode pod in a header.

In endpoint-picker mode the gateway sends the OpenAI request to the decode pod the
picker named. The pod's front (a ``pdserve router --prefill-from-header`` beside the
decode worker, docs/router.md) runs the prefill on the worker named in
``x-prefiller-host-port`` (llm-d's name for it) and pulls the KV as the router does.

The picker signs the value (``x-pdserve-prefill-sig``: HMAC under the service secret's
HTTP key), and the front honours only a signed one: a client that reaches the front
directly cannot point it at a host of its choosing. A signed value only ever names a
prefill worker that the picker saw, so a replay sends a prompt nowhere new. Without a
service secret (an unauthenticated local set-up) every value is taken, as every call is.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve import keys
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.routing import RoutePlan
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

PREFILL_HEADER = "x-prefiller-host-port"
SIGNATURE_HEADER = "x-pdserve-prefill-sig"
_LABEL = b"pdserve/prefill-endpoint"


def endpoint_of(url: str) -> str:
    """``http://10.0.0.5:8100`` → ``10.0.0.5:8100`` (the protocol's ``ip:port``)."""
    return url.split("://", 1)[-1].rstrip("/")


def sign(endpoint: str) -> str:
    return keys.KeyRing.from_env(keys.HTTP).sign(_LABEL, endpoint.encode()).hex()


def verified(endpoint: str, signature: str) -> bool:
    try:
        tag = bytes.fromhex(signature)
    except ValueError:
        return False
    ring = keys.KeyRing.from_env(keys.HTTP)
    return ring.verify(tag, _LABEL, endpoint.encode()) is not None


def pinned(headers: Mapping[str, str], plan: RoutePlan, snap: Snapshot) -> RoutePlan:
    """The plan the picker's headers ask for: remote prefill on the named worker (its
    polled view when discovery knows it), or local prefill when the picker named none.
    An unsigned or badly signed value is ignored: local prefill, never that host."""
    endpoint = headers.get(PREFILL_HEADER, "").strip()
    if not endpoint or not verified(endpoint, headers.get(SIGNATURE_HEADER, "")):
        return RoutePlan(disagg.LOCAL_PREFILL, (), plan.decode, 0)
    known = [w for w in snap.prefill if endpoint_of(w.url) == endpoint]
    worker = known[0] if known else WorkerView("http://" + endpoint, "prefill")
    return RoutePlan(disagg.REMOTE_PREFILL, (worker,), plan.decode, 0)
