"""Messages of the KV hand-off between prefill and decode workers.

``KVHandle`` is what a prefill worker returns with the first token: everything a
decode worker needs to pull the prompt's KV blocks and to release the lease.
``CompatRecord`` is exchanged at handshake; peers whose records differ in any
field are refused with an error naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pdserve.codec import message

KV_HANDLE_VERSION = 1


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
    kv_layout: str = "LKNBHD"  # [layers, k/v, blocks, block_size, kv_heads, head_dim]

    @classmethod
    def for_pool(cls, pool: Any, model: str) -> CompatRecord:
        """The record of a pool ``[layers, 2, blocks, block_size, kv_heads, head_dim]``."""
        assert pool.dim() == 6 and pool.shape[1] == 2, f"not a KV pool: {tuple(pool.shape)}"
        layers, _, _, block_size, kv_heads, head_dim = pool.shape
        dtype = str(pool.dtype).removeprefix("torch.")
        return cls(model, dtype, int(block_size), int(layers), int(kv_heads), int(head_dim))

    def mismatches(self, other: CompatRecord) -> list[str]:
        """Names of the fields that differ, each as ``name: ours != theirs``."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out


@message("kv_handle")
@dataclass(frozen=True)
class KVHandle:
    """A lease on a prompt's KV blocks held by one prefill worker."""

    request_id: str  # the lease id; the decode side releases by this id
    agent_name: str  # the prefill worker's NIXL agent (or tcp peer) name
    side_channel: str  # ZeroMQ address of the prefill worker's side channel (handshake, release)
    block_ids: list[int]  # block ids in the prefill worker's KV pool, in prompt order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    block_hashes: list[int]  # chained hashes of the full blocks (len == num_tokens // block_size)
    block_size: int
    lease_expires_at: float  # wall clock (time.time()) when the prefill side frees the blocks
    transport: str = "nixl"
    version: int = KV_HANDLE_VERSION
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if self.version != KV_HANDLE_VERSION:
            raise ValueError(f"kv_handle version {self.version} != {KV_HANDLE_VERSION}")
        if self.num_tokens <= 0:
            raise ValueError("kv_handle.num_tokens must be positive")
        if self.block_size <= 0:
            raise ValueError("kv_handle.block_size must be positive")
        need = -(-self.num_tokens // self.block_size)
        if len(self.block_ids) != need:
            raise ValueError(
                f"kv_handle has {len(self.block_ids)} block ids for {self.num_tokens} tokens "
                f"(block size {self.block_size} needs {need})"
            )
        if any((not isinstance(b, int)) or b < 0 for b in self.block_ids):
            raise ValueError("kv_handle.block_ids must be non-negative integers")
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError("kv_handle has more block hashes than blocks")


# --- side channel (prefill worker's ZMQ ROUTER; see docs/kv_transfer.md) ---------------------

SIDE_CHANNEL_VERSION = 1


def compat_from_dict(body: object) -> CompatRecord:
    """A CompatRecord from its plain-dict form (as nested in a handshake), with a clear error."""
    if not isinstance(body, dict):
        raise ValueError("compat must be an object")
    names = {f.name for f in fields(CompatRecord)}
    unknown = set(body) - names - {"type"}
    if unknown:
        raise ValueError(f"compat has unknown fields {sorted(unknown)}")
    try:
        return CompatRecord(**{k: v for k, v in body.items() if k != "type"})
    except TypeError as exc:
        raise ValueError(f"compat: {exc}") from exc


@message("kv_hello")
@dataclass(frozen=True)
class HandshakeRequest:
    """Decode → prefill on first contact: who I am and what my KV pool looks like."""

    transport: str  # "nixl" | "tcp"; must match the prefill side's
    agent_name: str
    agent_metadata: str  # base64 of the transport's metadata (NIXL agent metadata; "" for tcp)
    compat: dict[str, object]  # CompatRecord as a plain dict
    version: int = SIDE_CHANNEL_VERSION

    def validate(self) -> None:
        compat_from_dict(self.compat)

    def compat_record(self) -> CompatRecord:
        return compat_from_dict(self.compat)


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


@message("kv_release")
@dataclass(frozen=True)
class LeaseRelease:
    """Decode → prefill: done with the blocks of ``request_id`` (read finished or abandoned)."""

    request_id: str
    agent_name: str  # the releasing decode agent, for logs


@message("kv_release_ok")
@dataclass(frozen=True)
class LeaseReleaseAck:
    request_id: str


@message("kv_tcp_read")
@dataclass(frozen=True)
class TcpReadRequest:
    """Decode → prefill (tcp transport only): send me these blocks, all layers, k and v."""

    request_id: str
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
