"""The KV pool: one contiguous tensor per worker, sized from a memory budget.

Layout ``[layers, planes, num_blocks, block_size, kv_heads, head_dim]``: two planes
(K and V) on dim 1, or one under compressed MLA (``engine/mla.py``: one latent head per
token, which is both key and value). One tensor means one NIXL registration; a block of
one layer's plane is a contiguous run of ``block_size * kv_heads * head_dim`` elements.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

# Without an explicit budget a CPU worker takes this share of available memory, capped.
CPU_DEFAULT_FRACTION = 0.1
CPU_DEFAULT_CAP = 2 << 30
CUDA_DEFAULT_FRACTION = 0.85


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1 under compressed MLA (the latent is both)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token holds, all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token


def available_bytes(device: torch.device) -> int:
    """Memory a new pool can take: the GPU's free memory, or on the CPU the host's
    MemAvailable bounded by this process's memory cgroup (a container's limit: inside one,
    /proc/meminfo is the whole node's)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    host = 4 << 30
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                host = int(line.split()[1]) * 1024
                break
    room = cgroup_room()
    return host if room is None else min(host, room)


CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def cgroup_room(root: str = CGROUP_ROOT, self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """Bytes left under this process's memory cgroup limit (limit - usage + the inactive
    file cache the kernel would reclaim first, as the kubelet counts a working set); None
    without a limit or a readable cgroup. cgroup v2 (``memory.max``) or v1
    (``memory.limit_in_bytes``)."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: 0::/path
            files = ("memory.max", "memory.current", "inactive_file")
            dirs = (f"{root}{path}", root)
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            dirs = (f"{root}/memory{path}", f"{root}/memory")
        else:
            continue
        for d in dirs:  # the process's own group; in a cgroup namespace, the mount's root
            room = _room(d, *files)
            if room is not None:
                return room
    return None


def _room(d: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    base = Path(d)
    try:
        limit = (base / limit_file).read_text().strip()
        usage = int((base / usage_file).read_text())
        stat = dict(ln.split() for ln in (base / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= UNLIMITED:
        return None
    return max(0, int(limit) - usage + int(stat.get(inactive_key, 0)))


def budget_bytes(device: torch.device, explicit: int | None, fraction: float | None) -> int:
    if explicit is not None:
        room = available_bytes(device) if device.type == "cpu" else None
        if room is not None and explicit > room:  # the pool is touched lazily: say it now
            raise ValueError(
                f"--kv-cache-bytes {explicit} is more than the {room} bytes this worker can "
                f"take (MemAvailable, bounded by its memory cgroup's limit): the pool would "
                f"be killed for memory once it filled, so it is refused at start"
            )
        return explicit
    free = available_bytes(device)
    if fraction is not None:
        return int(free * fraction)
    if device.type == "cuda":
        return int(free * CUDA_DEFAULT_FRACTION)
    return min(int(free * CPU_DEFAULT_FRACTION), CPU_DEFAULT_CAP)


def zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU one backed by a private anonymous mapping.

    The kernel hands a mapping's pages out zeroed on first touch, so a CPU pool costs
    nothing until its blocks are used: ``torch.zeros`` wrote every page of the default
    2 GiB pool at start-up (~1 CPU-s, and the whole budget resident at once: six workers
    starting together on this 2-core, 24 GiB host took a minute, with the kernel
    reclaiming its page cache to find the memory). Resident memory now grows with the
    blocks in use, as with any lazily touched allocation; the pool's size is still the
    budget's, so admission and the router's view are unchanged."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps a reference to the mapping for as long as the tensor lives
    return torch.frombuffer(region, dtype=dtype).view(dims)


class KVPool:
    """Owns the KV tensor. Blocks are handed out by the BlockManager, not here."""

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"KV cache budget too small: one block needs {shape.bytes_per_block} bytes"
            )
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (
            shape.num_layers,
            shape.planes,
            num_blocks,
            shape.block_size,
            shape.num_kv_heads,
            shape.head_dim,
        )
        self.tensor = zeroed(dims, shape.dtype, device)
        flat = (num_blocks * shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Views made once: attention asks for them per layer per step (5 ops each).
        # With one plane the same view is both K and V (attention writes it once).
        self._layers = [(kv[0].view(flat), kv[-1].view(flat)) for kv in self.tensor]
        if shape.planes == 1:
            self._layers = [(k, k) for k, _ in self._layers]

    @classmethod
    def from_budget(cls, shape: KVShape, budget: int, device: torch.device) -> KVPool:
        return cls(shape, budget // shape.bytes_per_block, device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each ``[num_blocks * block_size, kv_heads, head_dim]``
        (one tensor twice under compressed MLA)."""
        return self._layers[layer_idx]
