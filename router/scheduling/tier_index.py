"""Which block hashes sit in the prefill workers' KV tiers, and what a hit there is worth.

Fed by the same KV events as the prefix index (``KVEvent.tier``: "host", "disk" or
"shared"; "pool" events stay in ``PrefixIndex``). A block in a worker's host or disk tier
is a hit on that worker only; a block in the shared tier (one Redis for the service) is a
hit on every prefill worker. A hit is worth its tier's weight (``--prefix-tier-weights``,
default ``host=0.8,disk=0.5,shared=0.3``; the pool is 1): roughly the share of the prefill
it saves once the load is paid. ``match`` sums the weights of each worker's leading
blocks, taking the best place the worker can get each block from, so a prompt whose
prefix is in worker A's pool and in the shared store scores A highest and every other
worker above a miss.

The shared tier's evictions are the server's own (LRU under ``maxmemory``) and send no
event: its entries are forgotten here beyond ``capacity`` (a stale one costs a recompute).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

TIERS = ("host", "disk", "shared")
DEFAULT_WEIGHTS: dict[str, float] = {"pool": 1.0, "host": 0.8, "disk": 0.5, "shared": 0.3}


def parse_weights(text: str) -> dict[str, float]:
    """``host=0.8,disk=0.5,shared=0.3`` (any subset) over the defaults."""
    out = dict(DEFAULT_WEIGHTS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in TIERS:
            raise ValueError(
                f"--prefix-tier-weights: {part!r} is not TIER=WEIGHT with TIER "
                f"one of {', '.join(TIERS)}"
            )
        weight = float(value)
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"--prefix-tier-weights: {name} weight must be in [0, 1]")
        out[name] = weight
    return out


class TierIndex:
    def __init__(self, capacity: int = 1_000_000, weights: Mapping[str, float] | None = None):
        self.capacity = capacity
        self.weights = dict(weights or DEFAULT_WEIGHTS)
        self._local: OrderedDict[int, dict[str, str]] = OrderedDict()  # hash -> worker -> tier
        self._shared: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._local) + len(self._shared)

    def stored(self, worker_id: str, tier: str, hashes: Sequence[int]) -> None:
        if tier == "shared":
            for h in hashes:
                self._shared[h] = None
                self._shared.move_to_end(h)
            while len(self._shared) > self.capacity:
                self._shared.popitem(last=False)
            return
        for h in hashes:
            holders = self._local.setdefault(h, {})
            # inclusive tiers: a block in host and disk counts at its faster tier
            if self.weights.get(tier, 0.0) >= self.weights.get(holders.get(worker_id, ""), 0.0):
                holders[worker_id] = tier
            self._local.move_to_end(h)
        while len(self._local) > self.capacity:
            self._local.popitem(last=False)

    def removed(self, worker_id: str, tier: str, hashes: Sequence[int]) -> None:
        if tier == "shared":
            for h in hashes:
                self._shared.pop(h, None)
            return
        for h in hashes:
            holders = self._local.get(h)
            if holders is not None and holders.get(worker_id) == tier:
                del holders[worker_id]
                if not holders:
                    del self._local[h]

    def drop_worker(self, worker_id: str) -> None:
        for h in [h for h, ws in self._local.items() if worker_id in ws]:
            del self._local[h][worker_id]
            if not self._local[h]:
                del self._local[h]

    def match(
        self, hashes: Sequence[int], pool: Mapping[str, int], workers: Iterable[str]
    ) -> dict[str, float]:
        """worker → weighted leading blocks: each block at the best weight the worker can
        have it (its pool per ``pool``, its own tiers, the shared tier); stops at the first
        block it cannot have."""
        if not self._local and not self._shared:
            return {}
        w_pool, w_shared = self.weights["pool"], self.weights["shared"]
        out: dict[str, float] = {}
        for worker in workers:
            total, in_pool = 0.0, pool.get(worker, 0)
            for i, h in enumerate(hashes):
                if i < in_pool:
                    total += w_pool
                    continue
                tier = self._local.get(h, {}).get(worker)
                weight = self.weights[tier] if tier is not None else 0.0
                if h in self._shared:
                    weight = max(weight, w_shared)
                if weight <= 0.0:
                    break
                total += weight
            if total > 0:
                out[worker] = total
        return out
