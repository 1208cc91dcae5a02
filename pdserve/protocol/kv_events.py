"""A worker's event stream: KV events (which block hashes its prefix cache gained or
lost) and load reports, on one ZeroMQ PUB socket.

Prefill workers publish ``[b"kv", codec bytes of KVEvent, ...]`` (one message per engine
step, one frame per event in ``seq`` order) and ``[b"stats", codec bytes of LoadReport]``;
decode workers publish the load reports only. (Before, every event was a message of its
own; a router of that age counts a step's message of several events as bad and resyncs
from the worker's snapshot: upgrade the routers first.) Every router replica
subscribes to every worker. ``seq`` grows by one per KV event per worker, so a
subscriber that sees a gap knows it missed something and resyncs; a load report carries
the ``kv_seq`` of the last KV event sent before it (the socket keeps their order), so a
lost trailing event is noticed too. ``GET /kv_blocks`` (``KVSnapshot``) is where a
subscriber that starts late, or lost events, gets the worker's blocks as of a ``seq``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.codec import message
from pdserve.protocol.contract import EngineStats

TOPIC = b"kv"
STATS_TOPIC = b"stats"
KINDS = ("stored", "removed", "cleared")
TIERS = ("pool", "host", "disk", "shared")


@message("kv_event")
@dataclass(frozen=True)
class KVEvent:
    kind: str  # "stored" | "removed" | "cleared"
    worker_id: str
    seq: int
    block_hashes: list[int] = field(default_factory=list)
    # Where the blocks are: the prefix cache ("pool") or a KV tier below it ("host", "disk",
    # "shared": engine/kv_tiers/). A router of before tiers reads every event as the pool's:
    # upgrade the routers first.
    tier: str = "pool"

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kv_event kind must be one of {KINDS}, got {self.kind!r}")
        if self.tier not in TIERS:
            raise ValueError(f"kv_event tier must be one of {TIERS}, got {self.tier!r}")


@message("load_report")
@dataclass(frozen=True)
class LoadReport(EngineStats):
    """The engine's counters as the worker pushes them (at least 10 times a second):
    what every router replica scores load from, instead of its own in-flight counts."""

    worker_id: str = ""
    kv_seq: int = 0  # seq of the last KV event published before this report (0: none)


@message("kv_snapshot")
@dataclass(frozen=True)
class KVSnapshot:
    """``GET /kv_blocks`` of a prefill worker: every block hash its prefix cache holds,
    as of KV event ``seq`` (the events after it change this set)."""

    worker_id: str
    seq: int
    block_hashes: list[int] = field(default_factory=list)
