"""Messages of the KV hand-off between prefill and decode workers.

``KVHandle`` is what a prefill worker returns with the first token: everything a
decode worker needs to pull the prompt's KV blocks and to release the lease.
``CompatRecord`` is exchanged at handshake; peers whose records differ in any
field are refused with an error naming the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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
