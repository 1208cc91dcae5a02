"""Paged KV block manager: reference counts, prefix cache, LRU eviction.

Free blocks wait in ``_free`` in eviction order (front evicted first). A freed
block keeps its hash: it stays a prefix-cache hit until it is reused, and only
then is its hash dropped (a ``removed`` event). Cached-but-unowned blocks
therefore count as free.

    hash_to_block ──▶ block ◀── owned by requests (ref_count > 0)
                        │
                        └─ ref_count == 0 ─▶ _free (LRU) ─▶ reused: hash dropped

The scheduler uses check/act pairs: ``can_allocate`` then ``allocate``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(frozen=True)
class Allocation:
    """Blocks for a prompt; the first ``num_cached_blocks`` already hold its KV."""

    block_ids: list[int]
    num_cached_blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # (kind, hashes) since the last drain; kind is "stored", "removed" or "cleared".
        # Recorded only for a consumer (the prefill worker's event publisher).
        self.record_events = False
        self._events: list[tuple[str, list[int]]] = []
        # (block id, hash) of a cached block about to be reused: its KV is still intact
        # (the KV tiers copy it down, engine/kv_tiers/attach.py)
        self.on_evict: Callable[[int, int], None] | None = None

    # -- queries ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute.

        At least the last prompt token must run through the model to produce
        logits, so a fully cached prompt hits all blocks but the last.
        """
        if not self.enable_prefix_caching:
            return []
        limit = min(len(hashes), (num_tokens - 1) // self.block_size)
        hits: list[int] = []
        for h in hashes[:limit]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, hits: Sequence[int], num_tokens: int) -> bool:
        # Hit blocks that sit in the free queue stop being free once taken.
        reclaimed = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(hits) <= self.num_free_blocks - reclaimed

    # -- actions ---------------------------------------------------------------
    def allocate(self, hits: Sequence[int], num_tokens: int) -> Allocation:
        assert self.can_allocate(hits, num_tokens)
        for b in hits:
            self._take(b)
        fresh = [self._pop_free() for _ in range(self.blocks_needed(num_tokens) - len(hits))]
        return Allocation(list(hits) + fresh, len(hits))

    def can_grow(self, block_ids: Sequence[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(block_ids) <= self.num_free_blocks

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append fresh blocks to ``block_ids`` until they hold ``num_tokens``."""
        assert self.can_grow(block_ids, num_tokens)
        while len(block_ids) * self.block_size < num_tokens:
            block_ids.append(self._pop_free())

    def free(self, block_ids: Sequence[int]) -> None:
        # Tail blocks first, so a sequence's last blocks are evicted before its prefix.
        for b in reversed(block_ids):
            block = self.blocks[b]
            assert block.ref_count > 0, f"double free of block {b}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[b] = None

    def register(self, block_ids: Sequence[int], hashes: Sequence[int], start: int) -> None:
        """Record the hashes of full, computed blocks ``start..len(hashes)`` for reuse."""
        if not self.enable_prefix_caching:
            return
        stored = []
        for i in range(start, len(hashes)):
            block = self.blocks[block_ids[i]]
            h = hashes[i]
            if block.block_hash is not None or h in self.hash_to_block:
                continue  # already cached, or an identical block is (keep the first)
            block.block_hash = h
            self.hash_to_block[h] = block.block_id
            stored.append(h)
        if stored and self.record_events:
            self._events.append(("stored", stored))

    def drain_events(self) -> list[tuple[str, list[int]]]:
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is owned."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.hash_to_block.clear()
        if self.record_events:
            self._events.append(("cleared", []))
        return True

    # -- internals -------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block_id, block.block_hash)
            del self.hash_to_block[block.block_hash]
            if self.record_events:
                self._events.append(("removed", [block.block_hash]))
            block.block_hash = None
        block.ref_count = 1
        return block_id
