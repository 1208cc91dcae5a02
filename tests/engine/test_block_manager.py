"""BlockManager: check/act pairs, reference counts, prefix hits, LRU eviction, events."""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free

from pdserve.engine.block_manager import BlockManager
from pdserve.protocol.hashing import block_hashes

pytestmark = pytest.mark.unit

BS = 4


def manager(num_blocks: int, enable_prefix_caching: bool = True) -> BlockManager:
    bm = BlockManager(num_blocks, BS, enable_prefix_caching)
    bm.record_events = True  # as under a KV event publisher
    return bm


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_allocate_and_free_round_trip() -> None:
    bm = manager(8)
    assert bm.blocks_needed(0) == 0 and bm.blocks_needed(1) == 1 and bm.blocks_needed(5) == 2
    alloc = bm.allocate([], 9)
    assert len(alloc.block_ids) == 3 and alloc.num_cached_blocks == 0
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[b].ref_count == 1 for b in alloc.block_ids)
    bm.free(alloc.block_ids)
    assert_all_free(bm)


def test_check_before_act() -> None:
    bm = manager(4)
    assert bm.can_allocate([], 16) and not bm.can_allocate([], 17)
    with pytest.raises(AssertionError):
        bm.allocate([], 17)
    alloc = bm.allocate([], 8)
    ids = list(alloc.block_ids)
    assert bm.can_grow(ids, 16) and not bm.can_grow(ids, 17)
    with pytest.raises(AssertionError):
        bm.grow(ids, 17)
    bm.grow(ids, 13)
    assert len(ids) == 4 and bm.num_free_blocks == 0
    bm.grow(ids, 16)  # already enough: nothing taken
    assert len(ids) == 4
    bm.free(ids)
    assert_all_free(bm)


def test_double_free_asserts() -> None:
    bm = manager(4)
    ids = bm.allocate([], 4).block_ids
    bm.free(ids)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(ids)
    assert_all_free(bm)


def _cached_request(bm: BlockManager, toks: list[int]) -> tuple[list[int], list[int]]:
    hashes = block_hashes(toks, BS)
    alloc = bm.allocate(bm.match_prefix(hashes, len(toks)), len(toks))
    bm.register(alloc.block_ids, hashes, alloc.num_cached_blocks)
    return alloc.block_ids, hashes


def test_prefix_hit_shares_blocks_with_ref_counts() -> None:
    bm = manager(16)
    a, hashes = _cached_request(bm, tokens(12))  # 3 full blocks, all registered
    assert bm.drain_events() == [("stored", hashes)]
    b_toks = [*tokens(10), 7, 7, 7]  # shares the first two blocks
    b_hashes = block_hashes(b_toks, BS)
    hits = bm.match_prefix(b_hashes, len(b_toks))
    assert hits == a[:2]
    b = bm.allocate(hits, len(b_toks))
    assert b.num_cached_blocks == 2 and b.block_ids[:2] == a[:2]
    assert [bm.blocks[x].ref_count for x in a] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in a] == [1, 1, 0]
    assert bm.num_free_blocks == 16 - 4
    bm.free(b.block_ids)
    assert_all_free(bm)


def test_match_prefix_leaves_at_least_one_token() -> None:
    bm = manager(16)
    a, hashes = _cached_request(bm, tokens(12))
    bm.free(a)
    # The whole 12-token prompt is cached, but its last token must run: 2 hits, not 3.
    assert len(bm.match_prefix(hashes, 12)) == 2
    assert len(bm.match_prefix(hashes, 13)) == 3
    assert bm.match_prefix(hashes[:1], 4) == []
    assert bm.match_prefix(block_hashes(tokens(12, start=500), BS), 12) == []
    assert_all_free(bm)


def test_cached_unowned_blocks_count_as_free_and_are_reclaimed() -> None:
    bm = manager(4)
    a, hashes = _cached_request(bm, tokens(12))
    bm.free(a)
    assert_all_free(bm)
    # Taking back the 2 hit blocks costs free blocks too: 2 hits + 2 fresh fit, not 3 fresh.
    hits = bm.match_prefix(hashes, 13)
    assert len(hits) == 3
    assert bm.can_allocate(hits[:2], 16) and not bm.can_allocate(hits[:2], 17)
    alloc = bm.allocate(hits[:2], 16)
    assert bm.num_free_blocks == 0
    bm.free(alloc.block_ids)
    assert_all_free(bm)


def test_lru_eviction_order() -> None:
    bm = manager(6)
    a, ha = _cached_request(bm, tokens(8, start=100))  # 2 blocks
    b, hb = _cached_request(bm, tokens(8, start=200))  # 2 blocks
    bm.drain_events()
    bm.free(a)  # freed first: evicted first, tail block before its prefix
    bm.free(b)
    assert list(bm._free)[-4:] == [a[1], a[0], b[1], b[0]]
    fresh = bm.allocate([], 12).block_ids  # 2 never-cached blocks, then a's tail block
    assert fresh[2] == a[1]
    assert bm.drain_events() == [("removed", [ha[1]])]
    # a's first block is still a hit; its second is gone, b is untouched.
    assert bm.match_prefix(ha, 9) == [a[0]]
    assert bm.match_prefix(hb, 9) == b
    # Reusing a hit refreshes nothing else: the next eviction takes a[0], then b's tail.
    more = bm.allocate([], 8).block_ids
    assert more == [a[0], b[1]]
    assert bm.drain_events() == [("removed", [ha[0]]), ("removed", [hb[1]])]
    bm.free(fresh)
    bm.free(more)
    assert_all_free(bm)


def test_register_keeps_the_first_of_identical_blocks() -> None:
    bm = manager(4)
    toks = tokens(8)
    hashes = block_hashes(toks, BS)
    a = bm.allocate([], 8).block_ids
    b = bm.allocate([], 8).block_ids  # computed the same prompt concurrently
    bm.register(a, hashes, 0)
    bm.register(b, hashes, 0)
    assert bm.drain_events() == [("stored", hashes)]
    assert [bm.hash_to_block[h] for h in hashes] == a
    bm.free(b)  # b's blocks carry no hash: reusing them removes nothing
    bm.free(a)
    assert bm.allocate([], 8).block_ids == [b[1], b[0]]
    assert bm.drain_events() == []
    bm.free([b[1], b[0]])
    assert_all_free(bm)


def test_prefix_caching_disabled() -> None:
    bm = manager(8, enable_prefix_caching=False)
    a, hashes = _cached_request(bm, tokens(12))
    assert bm.hash_to_block == {} and bm.drain_events() == []
    bm.free(a)
    assert bm.match_prefix(hashes, 13) == []
    assert_all_free(bm)


def test_no_events_without_a_consumer() -> None:
    bm = BlockManager(2, BS)
    a, _ = _cached_request(bm, tokens(8))
    bm.free(a)
    bm.free(bm.allocate([], 8).block_ids)  # evicts both cached blocks
    assert bm.drain_events() == []
    assert_all_free(bm)


def test_reset_prefix_cache_only_when_idle() -> None:
    bm = manager(8)
    a, hashes = _cached_request(bm, tokens(8))
    assert not bm.reset_prefix_cache()
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.match_prefix(hashes, 9) == []
    assert bm.drain_events()[-1] == ("cleared", [])
    assert_all_free(bm)
