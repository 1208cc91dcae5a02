"""Geometry of a KV pool and the byte ranges one request's blocks occupy in it.

The pool is one contiguous tensor ``[layers, planes, num_blocks, block_size, kv_heads,
head_dim]`` (two planes, K and V; one under compressed MLA, whose latent is both), so for a
layer ``l``, plane ``k`` and block ``b`` the block's bytes start at::

    ((l * planes + k) * num_blocks + b) * block_bytes

A request's blocks are a list of ids on each side; runs of ids that are consecutive on *both*
sides are merged into one range, so a transfer has ``layers * planes * runs`` descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PoolGeometry:
    """Where a pool's blocks are: enough to build descriptors for it from another process."""

    base_addr: int
    num_layers: int
    num_blocks: int
    block_bytes: int  # bytes of one block of one layer's plane (k or v, or the latent)
    device_id: int
    mem_type: str  # "DRAM" | "VRAM"
    planes: int = 2

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolGeometry:
        assert pool.dim() == 6 and pool.shape[1] in (1, 2), f"not a KV pool: {tuple(pool.shape)}"
        assert pool.is_contiguous(), "the KV pool must be one contiguous tensor"
        layers, planes, blocks = pool.shape[:3]
        block_bytes = pool[0, 0, 0].numel() * pool.element_size()
        cuda = pool.device.type == "cuda"
        return cls(
            base_addr=pool.data_ptr(),
            num_layers=int(layers),
            num_blocks=int(blocks),
            block_bytes=int(block_bytes),
            device_id=int(pool.device.index or 0) if cuda else 0,
            mem_type="VRAM" if cuda else "DRAM",
            planes=int(planes),
        )

    def request_bytes(self, num_blocks: int) -> int:
        """Bytes moved for ``num_blocks`` blocks: every layer, every plane."""
        return num_blocks * self.block_bytes * self.planes * self.num_layers


def merge_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` for maximal runs consecutive on both sides."""
    assert len(src_ids) == len(dst_ids)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def descriptors(geo: PoolGeometry, starts: list[int], lengths: list[int]) -> np.ndarray:
    """Nx3 ``(addr, len, device)`` rows, layer-major then plane then run, for NIXL dlists."""
    starts_a = np.asarray(starts, dtype=np.uint64)
    lens_a = np.asarray(lengths, dtype=np.uint64) * np.uint64(geo.block_bytes)
    planes = np.arange(geo.num_layers * geo.planes, dtype=np.uint64) * np.uint64(geo.num_blocks)
    offs = (planes[:, None] + starts_a[None, :]) * np.uint64(geo.block_bytes)
    out = np.empty((offs.size, 3), dtype=np.uint64)
    out[:, 0] = offs.reshape(-1) + np.uint64(geo.base_addr)
    out[:, 1] = np.broadcast_to(lens_a, offs.shape).reshape(-1)
    out[:, 2] = geo.device_id
    return out
