"""Where KV bytes cross between a GPU pool and the host, for the transports.

* NIXL registers the pool by its own address range and memory type: ``VRAM`` (with the
  GPU's index) for a CUDA pool, ``DRAM`` otherwise (:func:`registration`). The READ then
  lands straight in the decode worker's GPU pool; UCX moves it (NVLink, RDMA or its own
  staging) without a copy of ours.
* The tcp fallback sends bytes through ZeroMQ, which only reads host memory. For a CUDA
  pool each transfer goes through one **pinned** host buffer per transport (grown to the
  largest transfer, then reused): device<->pinned copies run at full PCIe speed and
  asynchronously, where a pageable copy is staged again by the driver. A CPU pool needs
  no staging at all.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from pdserve.transfer.layout import PoolGeometry


def registration(
    geometry: PoolGeometry, nbytes: int
) -> tuple[list[tuple[int, int, int, str]], str]:
    """The pool as one NIXL registration descriptor, and its memory type."""
    return [(geometry.base_addr, nbytes, geometry.device_id, "")], geometry.mem_type


class PinnedStaging:
    """A reusable host buffer between a CUDA pool and the wire. ``pin`` is False only in
    tests on machines without CUDA (pinning needs the driver)."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()  # serve() and check() may run on different threads
        self.grown = 0  # times the buffer was (re)allocated

    def _host(self, nbytes: int) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._buffer, self.grown = buf, self.grown + 1
        return buf[:nbytes]

    def to_host(self, data: torch.Tensor) -> np.ndarray:
        """``data`` (on the device) as a fresh host array for a ZeroMQ frame (the pinned
        buffer is reused by the next transfer, so the frame gets its own copy)."""
        flat = data.contiguous().view(torch.uint8).reshape(-1)
        with self._lock:
            host = self._host(flat.numel())
            host.copy_(flat, non_blocking=True)
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            return host.numpy().copy()

    def to_device(self, raw: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Host bytes ``raw`` ([n] uint8) on ``device``; the copy is ordered on the current
        stream before anything queued after it (the caller's index_copy_)."""
        with self._lock:
            host = self._host(raw.numel())
            host.copy_(raw)
            out = host.to(device, non_blocking=True)
            if out.is_cuda:  # the buffer is reused by the next transfer: wait for this copy
                torch.cuda.current_stream(out.device).synchronize()
            return out
