"""The scheduler's side of the tiers: requests waiting for their prefix from below.

A waiting request is admitted as usual (blocks allocated, pool hits taken). If the block
after its pool hits is one a tier may hold, it goes to ``WAITING_FOR_TIER_LOAD`` instead of
running: the store's loader copies the tier's blocks into the request's own blocks while
the rest of the batch keeps running. When ``poll`` reports the load (finished, or cut at its
deadline) the request runs from the first block that was not loaded: a miss, a bad entry,
a failed or slow tier all end the same way, in a recompute of the rest.

One object per engine, used from the engine thread only (``Scheduler.tiers``).
"""

from __future__ import annotations

from pdserve.engine.kv_tiers.store import TieredStore
from pdserve.engine.request import Request, RequestStatus


class TierLoading:
    def __init__(self, store: TieredStore, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.requests: dict[str, Request] = {}
        self.num_hit_tokens = 0  # prompt tokens loaded from tiers (not preempted ones)

    def __len__(self) -> int:
        return len(self.requests)

    def maybe_start(self, req: Request, num_cached_blocks: int) -> bool:
        """Start loading the blocks after the pool's hits, if a tier may have the next one
        (True: the request waits for the load instead of running now)."""
        # As for the pool's hits, the last prompt token always runs through the model.
        limit = min(len(req.block_hashes), (req.num_tokens - 1) // self.block_size)
        if num_cached_blocks >= limit:
            return False
        if not self.store.may_have(req.block_hashes[num_cached_blocks]):
            return False
        req.status = RequestStatus.WAITING_FOR_TIER_LOAD
        self.requests[req.request_id] = req
        self.store.start_load(
            req.request_id,
            req.block_hashes[num_cached_blocks:limit],
            req.block_ids[num_cached_blocks:limit],
        )
        return True

    def collect(self) -> list[Request]:
        """Requests whose load ended, ready to run (from their first unloaded block)."""
        ready = []
        for load in self.store.poll():
            req = self.requests.pop(load.request_id, None)
            if req is None:
                continue
            tokens = load.num_blocks * self.block_size
            req.num_computed_tokens += tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens += tokens
                self.num_hit_tokens += tokens
            req.status = RequestStatus.RUNNING
            ready.append(req)
        return ready

    def cancel(self, req: Request) -> bool:
        """Take ``req`` out (abort); its blocks are safe to free when this returns."""
        if self.requests.pop(req.request_id, None) is None:
            return False
        self.store.cancel(req.request_id)
        return True
