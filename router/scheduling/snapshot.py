"""What routing sees: an immutable picture of the workers at one instant.

Discovery builds a new :class:`Snapshot` from its latest health checks, the load each
worker pushed last (its event stream, at least 10 times a second: what every router
replica sees alike) and this replica's in-flight counters; routing functions only read
it, so they are pure and can be tested from a table of snapshots without any server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.contract import WorkerStats as WorkerStats  # what a worker's GET /stats says
from pdserve.protocol.once import once

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerView:
    """One worker as routing sees it: the worker's last load report (``reported``; else its
    last polled ``/stats``) plus this replica's own counters.

    With a fresh report, load is the worker's own count of everything it holds (every
    replica's requests) plus ``since_report``: what this replica sent it since that report
    (not in it yet). Without one (a stale or silent stream) the polled stats lag by up to a
    health interval, and this replica's in-flight count bounds them from below, as a
    single router did.
    """

    url: str
    role: str
    healthy: bool = True
    stats: WorkerStats = field(default_factory=WorkerStats)
    inflight: int = 0  # requests the router has outstanding on this worker
    inflight_prompt_tokens: int = 0  # their prompt tokens not yet prefilled
    reported: bool = False  # ``stats`` is a fresh load report pushed by the worker
    since_report: int = 0  # requests this replica added on it since that report
    since_report_tokens: int = 0  # and their prompt tokens

    def __post_init__(self) -> None:
        assert self.role in ROLES, self.role

    @property
    def worker_id(self) -> str:
        return self.stats.worker_id or self.url

    @property
    def queued_tokens(self) -> int:
        if self.reported:
            return self.stats.queued_prompt_tokens + self.since_report_tokens
        # Polled stats lag; the router's own count is current. Both count our requests.
        return max(self.stats.queued_prompt_tokens, self.inflight_prompt_tokens)

    @property
    def running(self) -> int:
        s = self.stats
        if self.reported:
            return s.running + s.waiting + s.loading + self.since_report
        return max(s.running + s.waiting + s.loading, self.inflight)

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

    # Worked out once per snapshot (it is immutable): a request reads each several times.
    @once
    def prefill(self) -> tuple[WorkerView, ...]:
        return self.role("prefill")

    @once
    def decode(self) -> tuple[WorkerView, ...]:
        return self.role("decode")

    @once
    def block_size(self) -> int:
        sizes = {w.stats.block_size for w in self.workers if w.healthy}
        return min(sizes) if sizes else 16

    @property
    def max_model_len(self) -> int:
        """Smallest context any healthy worker accepts (0 when none reported one)."""
        lens = [w.stats.max_model_len for w in self.workers if w.healthy and w.stats.max_model_len]
        return min(lens) if lens else 0
