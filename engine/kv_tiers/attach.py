"""Build an engine's tiers from its config and hook them into its KV manager and scheduler.

The hooks are two: the block manager calls ``on_evict`` when a cached block is reused
(a copy of it goes to the store's writer), and the scheduler holds a ``TierLoading``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_tiers import codec
from pdserve.engine.kv_tiers.config import TierConfig, make_tiers
from pdserve.engine.kv_tiers.sched import TierLoading
from pdserve.engine.kv_tiers.store import TieredStore

if TYPE_CHECKING:
    from pdserve.engine.engine_view import EngineView
    from pdserve.engine.kv_pool import KVPool


def block_view(pool: KVPool, block_id: int) -> torch.Tensor:
    """One block of every layer: ``[layers, planes, block_size, kv_heads, head_dim]``."""
    return pool.tensor[:, :, block_id]


def build_store(cfg: TierConfig, pool: KVPool, model_id: str) -> TieredStore:
    s = pool.shape
    shape = (s.num_layers, s.planes, s.block_size, s.num_kv_heads, s.head_dim)
    ns = codec.namespace(model_id, s.dtype, shape)
    cuda = pool.tensor.device.type == "cuda"
    stream = torch.cuda.Stream(pool.tensor.device) if cuda else None

    def write_block(block_id: int, block: torch.Tensor) -> None:
        if stream is None:
            block_view(pool, block_id).copy_(block)
            return
        with torch.cuda.stream(stream):  # off the engine's stream; done before it is reported
            block_view(pool, block_id).copy_(block, non_blocking=False)
        stream.synchronize()

    return TieredStore(
        make_tiers(cfg), ns, s.dtype, shape, write_block, cfg.load_timeout_s, cfg.write_queue_blocks
    )


def attach(engine: EngineView, cfg: TierConfig) -> TieredStore:
    pool = engine.kv.pool
    store = build_store(cfg, pool, engine.model_id)

    def on_evict(block_id: int, block_hash: int) -> None:
        if store.accepting():  # a full queue: not even the copy is made
            store.evicted(block_hash, block_view(pool, block_id).clone())
        else:
            store.stats.dropped_writes += 1

    engine.kv.block_manager.on_evict = on_evict
    engine.scheduler.tiers = TierLoading(store, engine.kv.block_size)
    return store


def detach(engine: EngineView) -> None:
    """Close the engine's tiers and unhook them (benches: one engine, several settings).
    Only when it has no work; the pool's prefix cache is reset too, so the next setting
    starts cold."""
    assert not engine.has_work and engine.kv.all_free
    if engine.tier_store is not None:
        engine.tier_store.close()
    engine.tier_store = None
    engine.kv.block_manager.on_evict = None
    engine.scheduler.tiers = None
    engine.kv.reset_prefix_cache()
