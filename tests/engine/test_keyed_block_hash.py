"""Prefix-cache block hashes are keyed and 128 bits (issue 24 item 6).

A hit compares only the hash. With a 64-bit unkeyed hash a tenant could search offline
for a prompt whose blocks collide with another tenant's, and read that tenant's KV.
Keyed with the service's key and 128 bits wide, the search cannot start. Before the
change, the width and key tests here fail (every hash < 2**64, equal under any secret).
The hashes keep flowing through the codec, KV events and the router's index unchanged.
"""

from __future__ import annotations

import json
import random

import pytest

from pdserve import env
from pdserve.protocol import hashing
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.contract import KVHandle
from pdserve.protocol.kv_events import KVEvent
from pdserve.router.scheduling.prefix_index import KVEventView, PrefixIndex

pytestmark = pytest.mark.unit

IDS = [random.Random(0).randrange(50_000) for _ in range(16 * 40 + 5)]


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv(env.BLOCK_HASH_KEY, raising=False)
    monkeypatch.setenv(env.SERVICE_SECRET, "service-a")
    return monkeypatch


def test_hashes_are_128_bits(service: pytest.MonkeyPatch) -> None:
    hashes = hashing.block_hashes(IDS, 16)
    assert len(hashes) == 40 and len(set(hashes)) == 40
    assert all(0 <= h < 2**128 for h in hashes)
    assert sum(h >= 2**64 for h in hashes) > 30  # would be 0 for a 64-bit hash


def test_hashes_are_keyed_per_service(service: pytest.MonkeyPatch) -> None:
    ours = hashing.block_hashes(IDS, 16)
    service.setenv(env.SERVICE_SECRET, "service-b")
    assert not set(ours) & set(hashing.block_hashes(IDS, 16))  # another service's cache
    service.setenv(env.BLOCK_HASH_KEY, "stable")
    pinned = hashing.block_hashes(IDS, 16)
    service.setenv(env.SERVICE_SECRET, "rotated")  # the secret rotates, the hash key stays
    assert hashing.block_hashes(IDS, 16) == pinned


def test_salt_per_tenant_and_the_chain_agree(service: pytest.MonkeyPatch) -> None:
    a, b = hashing.salt_root("tenant-a"), hashing.salt_root("tenant-b")
    assert a != b and hashing.ROOT_HASH not in (a, b) and a >= 0
    salted = hashing.block_hashes(IDS, 16, a)
    assert not set(salted) & set(hashing.block_hashes(IDS, 16, b))
    assert not set(salted) & set(hashing.block_hashes(IDS, 16))
    parent = a  # one block at a time, as the engine extends a request's hashes
    for i, h in enumerate(salted):
        parent = hashing.hash_block(parent, IDS[16 * i : 16 * (i + 1)])
        assert parent == h
    assert hashing.block_hashes(IDS[:15], 16) == []


def test_128_bit_hashes_cross_the_codec_events_and_index(service: pytest.MonkeyPatch) -> None:
    hashes = hashing.block_hashes(IDS, 16)
    event = KVEvent("stored", "w1", 1, hashes)
    view = KVEventView.parse(encode(event))
    assert list(view.block_hashes) == hashes
    index = PrefixIndex()
    index.apply(view)
    assert index.match(hashes) == {"w1": 40}
    assert index.match(hashing.block_hashes(IDS, 16, hashing.salt_root("x"))) == {}
    handle = KVHandle(
        "r", "agent", "tcp://h:1", list(range(41)), 16 * 40 + 5, hashes, 16, "nonce", 30.0, "tcp"
    )
    back = decode(encode(handle), KVHandle)
    assert back.block_hashes == hashes and back.problem("tcp", 16, hashes) == ""
    assert json.loads(encode(handle))["block_hashes"][0] == hashes[0]  # plain JSON integers
