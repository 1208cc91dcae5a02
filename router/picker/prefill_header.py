"""The prefill worker the endpoint picker chose, carried to the decode pod in a header.

In endpoint-picker mode the gateway sends the OpenAI request to the decode pod the
picker named. The pod's front (a ``pdserve router --prefill-from-header`` beside the
decode worker, docs/router.md) runs the prefill on the worker named in
``x-prefiller-host-port`` (llm-d's name for it) and pulls the KV as the router does.

The picker signs the value (``x-pdserve-prefill-sig: <unix time> <hex tag>``, an HMAC
under the service secret's ``prefill-pin`` key, a purpose of its own) over the endpoint,
the time and the SHA-256 of the request body it picked for; the front honours only a
value whose tag checks, whose time is within ``WINDOW_S`` of its clock and whose body is
the one it got (issue 44 item 10). A client that reaches the front directly cannot point
it at a host of its choosing, and a captured pair neither outlives the window nor pins
another prompt; what a replay can do is send the same prompt, within 30 s, to the
prefill worker the picker chose for it. The front has no prefill discovery of its own:
the picker's signature stands for the picker's discovery. Without a service secret (an
unauthenticated local set-up) every value is taken, as every call is.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping

from pdserve import keys
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.routing import RoutePlan
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

PREFILL_HEADER = "x-prefiller-host-port"
SIGNATURE_HEADER = "x-pdserve-prefill-sig"
_LABEL = b"pdserve/prefill-endpoint"
WINDOW_S = 30.0


def endpoint_of(url: str) -> str:
    """``http://10.0.0.5:8100`` → ``10.0.0.5:8100`` (the protocol's ``ip:port``)."""
    return url.split("://", 1)[-1].rstrip("/")


def sign(endpoint: str, body: bytes, now: float | None = None) -> str:
    """The signature header's value for ``endpoint`` picked for the request ``body``."""
    ts = f"{time.time() if now is None else now:.3f}"
    ring = keys.KeyRing.from_env(keys.PREFILL_PIN)
    tag = ring.sign(_LABEL, endpoint.encode(), ts.encode(), hashlib.sha256(body).digest())
    return f"{ts} {tag.hex()}"


def verified(endpoint: str, signature: str, body: bytes, now: float | None = None) -> bool:
    ring = keys.KeyRing.from_env(keys.PREFILL_PIN)
    if not ring:
        return True  # no secret: nothing is signed (see the module's note)
    ts, _, tag_hex = signature.partition(" ")
    try:
        tag, sent = bytes.fromhex(tag_hex), float(ts)
    except ValueError:
        return False
    if not abs((time.time() if now is None else now) - sent) <= WINDOW_S:
        return False
    parts = (_LABEL, endpoint.encode(), ts.encode(), hashlib.sha256(body).digest())
    return ring.verify(tag, *parts) is not None


def pinned(headers: Mapping[str, str], plan: RoutePlan, snap: Snapshot, body: bytes) -> RoutePlan:
    """The plan the picker's headers ask for: remote prefill on the named worker (its
    polled view when discovery knows it), or local prefill when the picker named none.
    An unsigned, badly signed, expired or other request's value is ignored: local
    prefill, never that host."""
    endpoint = headers.get(PREFILL_HEADER, "").strip()
    signature = headers.get(SIGNATURE_HEADER, "")
    if not endpoint or not verified(endpoint, signature, body):
        return RoutePlan(disagg.LOCAL_PREFILL, (), plan.decode, 0)
    known = [w for w in snap.prefill if endpoint_of(w.url) == endpoint]
    worker = known[0] if known else WorkerView("http://" + endpoint, "prefill")
    return RoutePlan(disagg.REMOTE_PREFILL, (worker,), plan.decode, 0)
