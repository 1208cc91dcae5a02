"""KV events: which block hashes a worker's prefix cache gained or lost.

Published by prefill workers on a ZeroMQ PUB socket as ``[b"kv", codec bytes]``;
the router's prefix index subscribes. ``seq`` grows by one per message per
worker, so a subscriber that sees a gap knows it missed something and resyncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.codec import message

TOPIC = b"kv"
KINDS = ("stored", "removed", "cleared")


@message("kv_event")
@dataclass(frozen=True)
class KVEvent:
    kind: str  # "stored" | "removed" | "cleared"
    worker_id: str
    seq: int
    block_hashes: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kv_event kind must be one of {KINDS}, got {self.kind!r}")
