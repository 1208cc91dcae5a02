"""``--kv-transport`` key → transport class, and the KV hand-off's defaults.

Torch-free (classes are imported on use), so the router, the operator, ``pdserve up`` and
the benchmarks take their choices from here: ``TRANSPORT_NAMES`` is what every
``--kv-transport`` flag, the operator's spec and the CRD enum accept (a test checks the
CRD). The ``tcp`` transport works without NIXL installed.
"""

from __future__ import annotations

import importlib
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.transfer.base import KVTransport

TRANSPORTS: dict[str, tuple[str, str]] = {
    "nixl": ("pdserve.transfer.nixl_transport", "NixlTransport"),
    "tcp": ("pdserve.transfer.tcp_transport", "TcpTransport"),
}
TRANSPORT_NAMES: tuple[str, ...] = tuple(sorted(TRANSPORTS))
DEFAULT_TRANSPORT = "nixl"
DEFAULT_LEASE_SECONDS = 30.0  # how long a prefill worker holds handed-off KV
DEFAULT_TRANSFER_TIMEOUT = 10.0  # seconds a decode worker gives one KV read


def transport_class(kind: str) -> type[KVTransport]:
    """The class of ``kind``; an instance is bound to one pool (registered once, then):
    ``transport_class(kind)(pool, compat, agent_name, initiator, secret)``, where
    ``initiator`` is the decode side (it reads), not the prefill side (it is read from)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown kv transport {kind!r}; valid: {list(TRANSPORT_NAMES)}")
    module, cls = TRANSPORTS[kind]
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def new_agent_name(role: str) -> str:
    """A process-unique agent name: a restarted worker must never reuse its old name."""
    return f"pdserve-{role}-{uuid.uuid4().hex[:12]}"
