"""Messages of the KV hand-off between prefill and decode workers.

``KVHandle`` (defined in :mod:`pdserve.protocol.contract`, re-exported here) is what a prefill
worker returns with the first token: everything a decode worker needs to claim the lease,
pull the prompt's KV blocks and end the lease.
``CompatRecord`` is exchanged at handshake; peers whose records differ in any
field are refused with an error naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pdserve.protocol.codec import message
from pdserve.protocol.contract import CONTRACT_VERSION
from pdserve.protocol.contract import KVHandle as KVHandle


@message("compat")
@dataclass(frozen=True)
class CompatRecord:
    """What must match for two workers to exchange KV blocks byte-for-byte."""

    model: str  # model identity: config hash + weights hash, see engine.model_id
    dtype: str  # "float32" | "bfloat16" | "float16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # [layers, k/v, blocks, block_size, kv_heads, head_dim]; "L1NBHD": one plane (MLA's latent)
    kv_layout: str = "LKNBHD"

    @classmethod
    def for_pool(cls, pool: Any, model: str) -> CompatRecord:
        """The record of a pool ``[layers, planes, blocks, block_size, kv_heads, head_dim]``."""
        assert pool.dim() == 6 and pool.shape[1] in (1, 2), f"not a KV pool: {tuple(pool.shape)}"
        layers, planes, _, block_size, kv_heads, head_dim = pool.shape
        dtype = str(pool.dtype).removeprefix("torch.")
        layout = "LKNBHD" if planes == 2 else "L1NBHD"
        return cls(model, dtype, int(block_size), int(layers), int(kv_heads), int(head_dim), layout)

    def mismatches(self, other: CompatRecord) -> list[str]:
        """Names of the fields that differ, each as ``name: ours != theirs``."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out


# --- side channel (prefill worker's ZMQ ROUTER; see docs/kv_transfer.md) ---------------------

SIDE_CHANNEL_VERSION = CONTRACT_VERSION


@message("kv_hello")
@dataclass(frozen=True)
class HandshakeRequest:
    """Decode → prefill on first contact: who I am and what my KV pool looks like."""

    transport: str  # "nixl" | "tcp"; must match the prefill side's
    agent_name: str
    agent_metadata: str  # base64 of the transport's metadata (NIXL agent metadata; "" for tcp)
    compat: CompatRecord
    version: int = SIDE_CHANNEL_VERSION


@message("kv_hello_ok")
@dataclass(frozen=True)
class HandshakeReply:
    """Prefill → decode: accepted; how to reach and address my KV pool."""

    transport: str
    agent_name: str
    agent_metadata: str  # base64 NIXL agent metadata ("" for tcp)
    num_blocks: int  # blocks in the prefill pool: the range a handle's block ids must fall in
    mem_type: str  # "DRAM" | "VRAM"
    device_id: int
    base_addr: int  # address of pool[0, 0, 0] in the prefill process (NIXL descriptors)
    version: int = SIDE_CHANNEL_VERSION


@message("kv_hello_refused")
@dataclass(frozen=True)
class HandshakeRefused:
    """Prefill → decode: refused; ``mismatches`` names each differing field."""

    error: str
    mismatches: list[str] = field(default_factory=list)
    version: int = SIDE_CHANNEL_VERSION


@message("kv_claim")
@dataclass(frozen=True)
class LeaseClaim:
    """Decode → prefill, before the READ: these blocks are mine now (single use)."""

    request_id: str
    nonce: str  # the handle's; a lease is claimed at most once
    agent_name: str  # the claiming decode agent: it must have passed the handshake


@message("kv_claimed")
@dataclass(frozen=True)
class LeaseClaimed:
    """Prefill → decode: claimed; the blocks stay until done/failed or ``ttl_s`` passes."""

    request_id: str
    ttl_s: float


@message("kv_done")
@dataclass(frozen=True)
class LeaseDone:
    """Decode → prefill: the read is over (``ok``: it completed; else failed/abandoned)."""

    request_id: str
    nonce: str
    agent_name: str
    ok: bool


@message("kv_done_ack")
@dataclass(frozen=True)
class LeaseDoneAck:
    """Prefill → decode: ``intact`` is True only if the claimed lease held the blocks from
    the claim until this message: only then may the decode side use what it read."""

    request_id: str
    intact: bool
    error: str = ""


@message("kv_tcp_read")
@dataclass(frozen=True)
class TcpReadRequest:
    """Decode → prefill (tcp transport only): send me these blocks, all layers, k and v."""

    request_id: str
    nonce: str  # the claimed lease's: only its blocks are served
    agent_name: str  # the agent that claimed it
    block_ids: list[int]


@message("kv_tcp_data")
@dataclass(frozen=True)
class TcpReadReply:
    """Prefill → decode (tcp transport only); a second frame carries ``num_bytes`` raw bytes
    laid out as ``pool[:, :, block_ids]`` (C order)."""

    request_id: str
    num_bytes: int


@message("kv_error")
@dataclass(frozen=True)
class SideChannelError:
    """Any request the side channel could not serve (bad message, wrong transport...)."""

    error: str
