"""The engine's KV cache behind one facade: the pool, its blocks, and the blocks that no
request owns any more but that may not be reused yet.

Callers outside the engine (the workers' cores, transports, benches, tests) see this,
never the block manager's tables or the pool's layout: the tensor to register with a
transport, counts, KV events, the leak check. The scheduler alone allocates, through the
block manager's check/act pairs (``block_manager``); the model runner alone reads and
writes the pool (``pool``, bound once at start-up).

Who frees what (all on the engine thread):

* a queued or running request's blocks: the engine, when the request ends
  (``free_request``);
* a handed-off request's (prefill): the holder owns them from ``hold`` until its
  ``freed`` gives them back (decode side done, lease expired, or ``release``);
  ``reclaim`` takes them back every step and from an idle hook;
* a load's blocks whose read could not be stopped (decode): kept here
  (``quarantine``) until the connector's ``unquarantined`` names the request.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.block_manager import Allocation, BlockManager
from pdserve.engine.kv_connector import HeldBlocks, KVConnector, KVHolder
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.request import Request
from pdserve.protocol.hashing import hash_block


class KVCacheManager:
    def __init__(self, pool: KVPool, block_size: int, enable_prefix_caching: bool) -> None:
        self.pool = pool
        self.block_manager = BlockManager(pool.num_blocks, block_size, enable_prefix_caching)
        self.holder: KVHolder = HeldBlocks()
        self.quarantined: dict[str, list[int]] = {}  # blocks a read may still write

    # -- what callers read --------------------------------------------------------
    @property
    def tensor(self) -> Any:
        """The pool's one tensor (``[layers, planes, blocks, block_size, kv_heads, head_dim]``):
        what a KV transport registers and reads or writes blocks of."""
        return self.pool.tensor

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached-but-unowned ones included."""
        return self.block_manager.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def all_free(self) -> bool:
        """No block is owned (the leak check at the end of every test and bench)."""
        return self.num_free_blocks == self.num_blocks and all(
            b.ref_count == 0 for b in self.block_manager.blocks
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return self.block_manager.blocks_needed(num_tokens)

    def cached_prefix(self, hashes: list[int], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (see ``match_prefix``)."""
        return self.block_manager.match_prefix(hashes, num_tokens)

    # -- KV events and the prefix cache ----------------------------------------------
    def record_events(self) -> None:
        """Keep stored/removed/cleared events for ``drain_events`` (the prefill worker's
        publisher; without a consumer they are not recorded)."""
        self.block_manager.record_events = True

    def drain_events(self) -> list[tuple[str, list[int]]]:
        return self.block_manager.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    # -- a request's blocks (the scheduler's check/act pairs) -------------------------
    def can_allocate(self, hits: list[int], num_tokens: int) -> bool:
        return self.block_manager.can_allocate(hits, num_tokens)

    def allocate(self, hits: list[int], num_tokens: int) -> Allocation:
        """``hits`` (cached blocks, taken) then fresh blocks up to ``num_tokens``."""
        return self.block_manager.allocate(hits, num_tokens)

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.block_manager.can_grow(block_ids, num_tokens)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Append fresh blocks to ``block_ids`` until they hold ``num_tokens``."""
        self.block_manager.grow(block_ids, num_tokens)

    def free_request(self, req: Request) -> None:
        if req.block_ids:
            self.block_manager.free(req.block_ids)
            req.block_ids = []

    def register_computed(self, req: Request) -> None:
        """Put the request's full, computed blocks in the prefix cache."""
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        if full > req.num_registered_blocks:
            self.block_manager.register(
                req.block_ids, req.block_hashes[:full], req.num_registered_blocks
            )
            req.num_registered_blocks = full

    def extend_hashes(self, req: Request) -> None:
        """Hash the request's newly full blocks (chained from its last hash)."""
        bs = self.block_size
        full = req.num_tokens // bs
        if full > len(req.block_hashes):
            parent = req.block_hashes[-1] if req.block_hashes else req.hash_root
            tokens = req.all_token_ids
            for i in range(len(req.block_hashes), full):
                parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
                req.block_hashes.append(parent)

    # -- the hand-off (prefill) --------------------------------------------------------
    def attach_holder(self, holder: KVHolder) -> None:
        assert not self.held_ids(), "requests are held already"
        self.holder = holder

    def hold(self, req: Request) -> tuple[Any, list[int], list[int]]:
        """Give the request's blocks to the holder: its handle, the prompt's block ids
        and the prompt's full-block hashes (what the first token goes out with)."""
        block_ids, req.block_ids = req.block_ids, []
        num_prompt_blocks = self.blocks_needed(req.num_prompt_tokens)
        hashes = req.block_hashes[: req.num_prompt_tokens // self.block_size]
        handle = self.holder.hold(req.request_id, block_ids, req.num_prompt_tokens, hashes)
        return handle, block_ids[:num_prompt_blocks], hashes

    def held_ids(self) -> set[str]:
        return self.holder.held_ids()

    def release(self, request_id: str) -> bool:
        """End a hold now (abort); its blocks come back on the next ``reclaim``."""
        return self.holder.release(request_id)

    # -- quarantine (decode) ----------------------------------------------------------
    def quarantine(self, req: Request) -> None:
        """Keep a load's blocks out of use: the read may still write them."""
        self.quarantined[req.request_id], req.block_ids = req.block_ids, []

    def reclaim(self, connector: KVConnector | None) -> None:
        """Take back the blocks of ended holds and of reads that stopped."""
        for block_ids in self.holder.freed():
            self.block_manager.free(block_ids)
        for rid in connector.unquarantined() if connector is not None else []:
            self.block_manager.free(self.quarantined.pop(rid, []))
