"""Pure pieces: run merging, descriptors, the registry, message round trips."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pdserve.protocol.codec import CodecError, decode, encode, from_dict, to_dict
from pdserve.transfer.layout import PoolGeometry, descriptors, merge_runs
from pdserve.transfer.messages import CompatRecord, HandshakeRequest, TcpReadRequest
from pdserve.transfer.registry import TRANSPORTS, transport_class

pytestmark = pytest.mark.unit


def test_merge_runs_needs_both_sides_consecutive() -> None:
    assert merge_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert merge_runs([4, 5, 6], [0, 2, 3]) == [(4, 0, 1), (5, 2, 2)]
    assert merge_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert merge_runs([], []) == []


def test_descriptors_address_every_layer_and_kv() -> None:
    pool = torch.zeros(3, 2, 10, 4, 2, 8)
    geo = PoolGeometry.of(pool)
    assert geo.block_bytes == 4 * 2 * 8 * 4 and geo.num_blocks == 10
    rows = descriptors(geo, [2, 7], [3, 1])
    assert rows.shape == (3 * 2 * 2, 3)
    for i, (layer, kv, start, n) in enumerate(
        (layer, kv, s, n) for layer in range(3) for kv in range(2) for s, n in [(2, 3), (7, 1)]
    ):
        assert rows[i, 0] == pool[layer, kv, start].data_ptr()
        assert rows[i, 1] == n * geo.block_bytes
    assert geo.request_bytes(4) == 4 * geo.block_bytes * 2 * 3


def test_one_plane_pool_addresses_each_layer_once() -> None:
    """Compressed MLA's pool (one latent plane, engine/mla.py): a descriptor per layer and
    run, the bytes of one plane, and a layout its expanded twin refuses at handshake."""
    pool = torch.zeros(3, 1, 10, 4, 1, 40)
    geo = PoolGeometry.of(pool)
    assert geo.planes == 1 and geo.block_bytes == 4 * 40 * 4
    rows = descriptors(geo, [2, 7], [3, 1])
    assert rows.shape == (3 * 2, 3)
    for i, (layer, start, n) in enumerate(
        (layer, s, n) for layer in range(3) for s, n in [(2, 3), (7, 1)]
    ):
        assert rows[i, 0] == pool[layer, 0, start].data_ptr()
        assert rows[i, 1] == n * geo.block_bytes
    assert geo.request_bytes(4) == 4 * geo.block_bytes * 3
    latent = CompatRecord.for_pool(pool, "m")
    expanded = CompatRecord.for_pool(torch.zeros(3, 2, 10, 4, 1, 40), "m")
    assert latent.kv_layout == "L1NBHD"
    assert latent.mismatches(expanded) == ["kv_layout: 'L1NBHD' != 'LKNBHD'"]


def test_registry_unknown_key_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown kv transport 'rdma'; valid: \['nixl', 'tcp'\]"):
        transport_class("rdma")
    assert sorted(TRANSPORTS) == ["nixl", "tcp"]


@pytest.mark.parametrize("kind", sorted(TRANSPORTS))
def test_registry_binds_pool(kind: str) -> None:
    pool = torch.zeros(2, 2, 4, 4, 2, 8)
    t = transport_class(kind)(pool, CompatRecord.for_pool(pool, "m"), f"unit-{kind}")
    try:
        assert t.name == kind and t.agent_name == f"unit-{kind}"
        assert t.geometry.base_addr == pool.data_ptr()
    finally:
        t.close()


def test_compat_for_pool_and_messages_round_trip() -> None:
    pool = torch.zeros(2, 2, 4, 16, 8, 64, dtype=torch.bfloat16)
    compat = CompatRecord.for_pool(pool, "m")
    assert compat == CompatRecord("m", "bfloat16", 16, 2, 8, 64)
    req = HandshakeRequest("nixl", "a", "bWQ=", compat)
    back = decode(encode(req), HandshakeRequest)
    assert back.compat == compat
    tcp = TcpReadRequest("r", "n", "a", [1, 2])
    assert decode(encode(tcp)) == tcp
    body = to_dict(req)
    with pytest.raises(CodecError, match="unknown fields") as info:
        from_dict({**body, "compat": {**body["compat"], "x": 1}})
    assert info.value.field == "x"
    with pytest.raises(CodecError, match="compat"):
        from_dict({**body, "compat": {"model": "m"}})
    with pytest.raises(CodecError, match=r"kv_tcp_read\.block_ids: must be a list") as info:
        from_dict({**to_dict(tcp), "block_ids": 3})
    assert info.value.field == "block_ids"


def _thread_cpu_ticks() -> dict[str, int]:
    out = {}
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[task] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_idle_prefill_agent_does_not_spin() -> None:
    """NIXL's Python API starts the UCX progress thread as a busy loop; ours sleeps between
    rounds, so an idle prefill worker does not burn a core."""
    pool = torch.zeros(2, 2, 4, 4, 2, 8)
    t = transport_class("nixl")(pool, CompatRecord.for_pool(pool, "m"), "unit-idle")
    try:
        time.sleep(0.3)
        before = _thread_cpu_ticks()
        time.sleep(2.0)
        after = _thread_cpu_ticks()
        busiest = max(after[k] - before.get(k, 0) for k in after) / os.sysconf("SC_CLK_TCK")
        assert busiest < 0.2, f"a thread used {busiest:.2f}s of CPU in 2s while idle"
    finally:
        t.close()
