"""What routing sees: an immutable picture of the workers at one instant.

Discovery builds a new :class:`Snapshot` from its latest health checks and the
router's in-flight counters; routing functions only read it, so they are pure
and can be tested from a table of snapshots without any server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerStats:
    """The fields of a worker's ``GET /stats`` that routing uses."""

    worker_id: str = ""
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    queued_prompt_tokens: int = 0
    block_size: int = 16
    max_model_len: int = 0
    kv_events: str = ""  # ZeroMQ address of a prefill worker's KV events; "" on decode

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WorkerStats:
        def num(key: str, default: int = 0) -> int:
            value = body.get(key, default)
            return int(value) if isinstance(value, (int, float)) else default

        return cls(
            worker_id=str(body.get("worker_id") or ""),
            running=num("running"),
            waiting=num("waiting"),
            kv_blocks_free=num("kv_blocks_free"),
            kv_blocks_total=num("kv_blocks_total"),
            queued_prompt_tokens=num("queued_prompt_tokens"),
            block_size=num("block_size", 16) or 16,
            max_model_len=num("max_model_len"),
            kv_events=str(body.get("kv_events") or ""),
        )


@dataclass(frozen=True)
class WorkerView:
    """One worker as routing sees it: last polled stats plus the router's own counters."""

    url: str
    role: str
    healthy: bool = True
    stats: WorkerStats = field(default_factory=WorkerStats)
    inflight: int = 0  # requests the router has outstanding on this worker
    inflight_prompt_tokens: int = 0  # their prompt tokens not yet prefilled

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role

    @property
    def worker_id(self) -> str:
        return self.stats.worker_id or self.url

    @property
    def queued_tokens(self) -> int:
        # Polled stats lag; the router's own count is current. Both count our requests.
        return max(self.stats.queued_prompt_tokens, self.inflight_prompt_tokens)

    @property
    def running(self) -> int:
        return max(self.stats.running + self.stats.waiting, self.inflight)

    @property
    def kv_free_fraction(self) -> float:
        total = self.stats.kv_blocks_total
        return self.stats.kv_blocks_free / total if total > 0 else 0.0


@dataclass(frozen=True)
class Snapshot:
    workers: tuple[WorkerView, ...] = ()
    version: int = 0

    def role(self, role: str, healthy_only: bool = True) -> tuple[WorkerView, ...]:
        return tuple(w for w in self.workers if w.role == role and (w.healthy or not healthy_only))

    @property
    def prefill(self) -> tuple[WorkerView, ...]:
        return self.role("prefill")

    @property
    def decode(self) -> tuple[WorkerView, ...]:
        return self.role("decode")

    @property
    def block_size(self) -> int:
        sizes = {w.stats.block_size for w in self.workers if w.healthy}
        return min(sizes) if sizes else 16

    @property
    def max_model_len(self) -> int:
        """Smallest context any healthy worker accepts (0 when none reported one)."""
        lens = [w.stats.max_model_len for w in self.workers if w.healthy and w.stats.max_model_len]
        return min(lens) if lens else 0
