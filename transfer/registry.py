"""``--kv-transport`` key → transport class. Imports are lazy so ``tcp`` works without NIXL."""

from __future__ import annotations

import importlib
import uuid

import torch

from pdserve.transfer.base import KVTransport
from pdserve.transfer.messages import CompatRecord

TRANSPORTS: dict[str, tuple[str, str]] = {
    "nixl": ("pdserve.transfer.nixl_transport", "NixlTransport"),
    "tcp": ("pdserve.transfer.tcp_transport", "TcpTransport"),
}


def transport_class(kind: str) -> type[KVTransport]:
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown kv transport {kind!r}; valid: {sorted(TRANSPORTS)}")
    module, cls = TRANSPORTS[kind]
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def make_transport(
    kind: str, pool: torch.Tensor, compat: CompatRecord, agent_name: str, initiator: bool = False
) -> KVTransport:
    """A transport of ``kind`` bound to ``pool`` (registered once, here); ``initiator`` on the
    decode side (it reads), not on the prefill side (it is read from)."""
    return transport_class(kind)(pool, compat, agent_name, initiator)


def new_agent_name(role: str) -> str:
    """A process-unique agent name: a restarted worker must never reuse its old name."""
    return f"pdserve-{role}-{uuid.uuid4().hex[:12]}"
