"""KV bytes between a GPU pool and the host: NIXL's registration switch and the tcp
fallback's pinned staging buffer, as far as a machine without CUDA can run them.

A CUDA pool's real path (VRAM registration read by UCX, pinned copies) runs in
test_kv_pair.py::test_cuda_pools where a GPU is present; here the VRAM geometry is built
by hand and the staging buffer is unpinned (pinning needs the CUDA driver).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from kv_helpers import make_pool

from pdserve.transfer import nixl_transport
from pdserve.transfer.layout import PoolGeometry
from pdserve.transfer.messages import CompatRecord
from pdserve.transfer.staging import PinnedStaging, registration

pytestmark = pytest.mark.unit


def test_registration_names_the_memory_type() -> None:
    pool = make_pool(4, seed=0)
    host = PoolGeometry.of(pool)
    descs, mem_type = registration(host, pool.nbytes)
    assert mem_type == "DRAM" and descs == [(pool.data_ptr(), pool.nbytes, 0, "")]
    vram = replace(host, base_addr=0x7F00_0000_0000, device_id=3, mem_type="VRAM")  # GPU 3's
    descs, mem_type = registration(vram, pool.nbytes)
    assert mem_type == "VRAM" and descs == [(0x7F00_0000_0000, pool.nbytes, 3, "")]


def test_nixl_registers_by_address_and_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport hands NIXL the pool's range and type, not a tensor to guess from
    (a fake agent records the call; the real one runs in test_kv_pair.py)."""
    calls: list[tuple[Any, Any]] = []

    class Agent:
        backends = ("UCX",)

        def register_memory(self, descs: Any, mem_type: Any = None) -> str:
            calls.append((descs, mem_type))
            return "reg"

    monkeypatch.setattr(nixl_transport, "_make_agent", lambda *_a, **_k: Agent())
    pool = make_pool(4, seed=0)
    nixl_transport.NixlTransport(pool, CompatRecord.for_pool(pool, "m"), "a")
    assert calls == [([(pool.data_ptr(), pool.nbytes, 0, "")], "DRAM")]


def test_staging_round_trip_reuses_one_buffer() -> None:
    staging = PinnedStaging(pin=False)
    data = torch.randn(3, 5, 16)
    raw = staging.to_host(data)
    assert raw.tobytes() == data.view(torch.uint8).numpy().tobytes()
    back = staging.to_device(torch.from_numpy(raw), data.device)
    assert torch.equal(back.view(torch.float32).view(3, 5, 16), data)
    staging.to_host(data[:1])  # smaller: the same buffer
    assert staging.grown == 1
    staging.to_host(torch.randn(4, 5, 16))  # larger: grown once more, then reused
    staging.to_host(torch.randn(4, 5, 16))
    assert staging.grown == 2


def test_tcp_transport_stages_only_a_cuda_pool() -> None:
    """A CPU pool is sent from its own memory (no staging); a CUDA pool would get the pinned
    buffer (test_kv_pair.py::test_cuda_pools runs that where a GPU is present)."""
    from pdserve.transfer.tcp_transport import TcpTransport

    pool = make_pool(4, seed=0)
    assert TcpTransport(pool, CompatRecord.for_pool(pool, "m"), "a")._staging is None
