"""The store's counters: hits and bytes per tier, load latency, and what went wrong.

Written by the store's threads (plain int adds: a lost increment under a race would
only undercount), read by the engine's stats and the worker's /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

# seconds: the load latency histogram's upper bounds (Prometheus style, +Inf implied)
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class TierStats:
    tiers: list[str]
    hits: dict[str, int] = field(default_factory=dict)  # blocks read back, per tier
    bytes_read: dict[str, int] = field(default_factory=dict)
    bytes_written: dict[str, int] = field(default_factory=dict)
    blocks_written: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    misses: int = 0  # blocks a load looked for and no tier had
    bad_entries: int = 0  # entries that failed verification (recomputed)
    dropped_writes: int = 0  # evicted blocks not written: the queue was full
    loads: int = 0
    load_timeouts: int = 0
    blocks_loaded: int = 0
    load_seconds_sum: float = 0.0
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))

    def __post_init__(self) -> None:
        for d in (self.hits, self.bytes_read, self.bytes_written, self.blocks_written, self.errors):
            for t in self.tiers:
                d.setdefault(t, 0)

    def hit(self, tier: str, nbytes: int) -> None:
        self.hits[tier] += 1
        self.bytes_read[tier] += nbytes

    def wrote(self, tier: str, nbytes: int) -> None:
        self.blocks_written[tier] += 1
        self.bytes_written[tier] += nbytes

    def error(self, tier: str) -> None:
        self.errors[tier] += 1

    def loaded(self, blocks: int, seconds: float, timed_out: bool) -> None:
        self.loads += 1
        self.blocks_loaded += blocks
        self.load_timeouts += int(timed_out)
        self.load_seconds_sum += seconds
        i = next((i for i, b in enumerate(LOAD_BUCKETS) if seconds <= b), len(LOAD_BUCKETS))
        self.load_buckets[i] += 1

    def as_dict(self) -> dict[str, object]:
        """Plain values (what crosses to the worker's front end with the engine's stats)."""
        return {
            k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
            for k, v in self.__dict__.items()
        }
