"""CUDA graphs for decode steps: captured once per batch-size bucket, replayed per step.

A decode step's launches (a few per layer) cost more CPU time than the GPU spends on
them at small batches; a graph replays them all in one call. A graph replays the exact
kernels it recorded, over the exact addresses, so:

* the step reads its inputs from **static tensors** made once for the largest bucket;
  each bucket's graph reads a prefix of them (views: same addresses every replay);
* a batch of ``n`` runs in the smallest bucket ``b >= n``; rows ``n .. b`` are padding:
  slot ``-1`` (``triton_attention.store_kv`` writes nothing for it) and tiles of zero
  tokens (the attention kernel writes nothing for them); their logits are dropped;
* a step no bucket fits (more requests than the largest bucket, or any prefill token)
  runs eagerly, as without graphs.

The model runner turns graphs on with ``ModelRunner.enable_cuda_graphs()`` (CUDA, the
Triton back-end, after ``bind_pool``; bench/gpu_smoke.py measures with and without; not
on by default until measured on a GPU): a step whose chunks are all decodes goes through
:meth:`DecodeGraphs.run`, any other step runs as before.

The capture itself is behind :class:`GraphRunner`: :class:`CudaGraphRunner` records on
a side stream with ``torch.cuda.CUDAGraph`` (one memory pool shared by all buckets,
largest captured first); the tests use a fake runner whose replay re-runs the step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.model_support import LayerAttention
    from pdserve.engine.sched_output import ScheduledChunk

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PAD_SLOT = -1  # a padding row's KV slot: nothing is written


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step, host side: each request's token, its position, the pool slot its
    K/V go to, and its blocks (covering position + 1 tokens)."""

    token_ids: Sequence[int]
    positions: Sequence[int]
    slots: Sequence[int]
    block_tables: Sequence[Sequence[int]]

    @property
    def size(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepView:
    """The static tensors one bucket's step reads (prefixes of :class:`StaticInputs`)."""

    input_ids: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64
    slot_mapping: torch.Tensor  # [b] int64, PAD_SLOT for padding rows
    tables: torch.Tensor  # [b, max_blocks] int32
    tile_row: torch.Tensor  # [b] int32: tile i is row i
    tile_count: torch.Tensor  # [b] int32: 1, or 0 for padding
    tile_ctx: torch.Tensor  # [b] int32: position + 1
    tile_table: torch.Tensor  # [b] int32: row i of tables


class StaticInputs:
    """Fixed-address input tensors for batches up to ``max_batch`` requests."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.input_ids = zeros(max_batch, dtype=torch.int64)
        self.positions = zeros(max_batch, dtype=torch.int64)
        self.slot_mapping = zeros(max_batch, dtype=torch.int64)
        self.tables = zeros(max_batch, max_blocks)
        self.tile_count = zeros(max_batch)
        self.tile_ctx = zeros(max_batch)
        rows = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.tile_row, self.tile_table = rows, rows.clone()  # never change

    def view(self, bucket: int) -> StepView:
        b = bucket
        return StepView(
            self.input_ids[:b],
            self.positions[:b],
            self.slot_mapping[:b],
            self.tables[:b],
            self.tile_row[:b],
            self.tile_count[:b],
            self.tile_ctx[:b],
            self.tile_table[:b],
        )

    def fill(self, batch: DecodeBatch, bucket: int) -> None:
        """Copies ``batch`` in, padded to ``bucket`` rows (one host->device copy each)."""
        n = batch.size
        assert n <= bucket <= self.max_batch
        width = max((len(t) for t in batch.block_tables), default=0)
        if width > self.max_blocks:
            raise ValueError(f"a context of {width} blocks exceeds the graphs' {self.max_blocks}")
        ids = torch.zeros(bucket, dtype=torch.int64)
        pos = torch.zeros(bucket, dtype=torch.int64)
        slots = torch.full((bucket,), PAD_SLOT, dtype=torch.int64)
        count = torch.zeros(bucket, dtype=torch.int32)
        ids[:n] = torch.tensor(batch.token_ids, dtype=torch.int64)
        pos[:n] = torch.tensor(batch.positions, dtype=torch.int64)
        slots[:n] = torch.tensor(batch.slots, dtype=torch.int64)
        count[:n] = 1
        tables = torch.zeros((n, width), dtype=torch.int32)
        for i, blocks in enumerate(batch.block_tables):
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.input_ids[:bucket].copy_(ids, non_blocking=True)
        self.positions[:bucket].copy_(pos, non_blocking=True)
        self.slot_mapping[:bucket].copy_(slots, non_blocking=True)
        self.tile_count[:bucket].copy_(count, non_blocking=True)
        self.tile_ctx[:bucket].copy_((pos + 1).to(torch.int32), non_blocking=True)
        # Table entries past a request's blocks are never read: only the used part is copied.
        self.tables[:n, :width].copy_(tables, non_blocking=True)


class GraphRunner(Protocol):
    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Records ``step`` once; the returned function replays it and returns its
        output tensor (the same tensor, overwritten, on every replay)."""
        ...


class CudaGraphRunner:
    """Captures with ``torch.cuda.CUDAGraph``: warm-up runs on a side stream (lazy
    initialisations must not be recorded), then one recorded run; every graph shares
    one memory pool, so buckets captured largest first fit in the first one's memory."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup
        self.mem_pool: Any = None  # torch's opaque pool handle

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mem_pool):
            out = step()
        self.mem_pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """Decode steps through per-bucket graphs; ``step(view)`` is the model's forward over
    a bucket's static inputs, returning logits for every row."""

    def __init__(
        self,
        step: Callable[[StepView], torch.Tensor],
        max_blocks: int,
        device: torch.device,
        runner: GraphRunner,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
    ) -> None:
        assert buckets and all(b > 0 for b in buckets)
        self.buckets = sorted(set(buckets))
        self.step, self.runner = step, runner
        self.inputs = StaticInputs(self.buckets[-1], max_blocks, device)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        self.replays = self.eager_steps = 0

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket that holds ``batch_size`` requests; None past the largest."""
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def capture(self) -> None:
        """Records every bucket, largest first, over a dummy batch (padding rows only)."""
        empty = DecodeBatch((), (), (), ())
        for bucket in reversed(self.buckets):
            self.inputs.fill(empty, bucket)
            self.graphs[bucket] = self.runner.capture(self._bound(self.inputs.view(bucket)))

    def _bound(self, view: StepView) -> Callable[[], torch.Tensor]:
        return lambda: self.step(view)

    def run(self, batch: DecodeBatch, eager: Callable[[DecodeBatch], torch.Tensor]) -> torch.Tensor:
        """Logits of ``batch``'s rows: replayed from its bucket's graph, or ``eager(batch)``."""
        bucket = self.bucket_for(batch.size)
        if bucket is None or bucket not in self.graphs:
            self.eager_steps += 1
            return eager(batch)
        self.inputs.fill(batch, bucket)
        self.replays += 1
        return self.graphs[bucket]()[: batch.size]


# --- the model runner's side --------------------------------------------------------------


class StepModel(Protocol):
    """What a captured step reads of the model runner (model_runner.py), which imports
    this module: its pool, its layers' attention options and its forward."""

    @property
    def pool(self) -> KVPool | None: ...

    @property
    def layers(self) -> tuple[LayerAttention, ...]: ...

    @property
    def architecture(self) -> str: ...

    @property
    def forward(self) -> Callable[..., Any]: ...


def decode_batch(chunks: Sequence[ScheduledChunk], block_size: int) -> DecodeBatch:
    """A step of decodes (one token each) as a :class:`DecodeBatch`."""
    tokens, positions, slots, tables = [], [], [], []
    for c in chunks:
        req, p = c.request, c.start
        n = req.num_prompt_tokens
        tokens.append(req.prompt_token_ids[p] if p < n else req.output_token_ids[p - n])
        positions.append(p)
        slots.append(req.block_ids[p // block_size] * block_size + p % block_size)
        tables.append(req.block_ids[: p // block_size + 1])
    return DecodeBatch(tokens, positions, slots, tables)


def model_step(runner: StepModel) -> Callable[[StepView], torch.Tensor]:
    """The runner's forward over a bucket's static inputs, through the Triton attention:
    logits of every row (the graph records this; its Python runs only at capture)."""
    from pdserve.engine.attention import CURRENT, AttentionMetadata
    from pdserve.engine.triton_attention import Tiles, TritonMetadata

    def step(view: StepView) -> torch.Tensor:
        tiles = Tiles(view.tile_row, view.tile_count, view.tile_ctx, view.tile_table, 1)
        meta = TritonMetadata(view.tables, (tiles,))
        CURRENT.pool = runner.pool
        CURRENT.meta = AttentionMetadata(view.slot_mapping, [], [], triton=meta)
        CURRENT.layers, CURRENT.architecture = runner.layers, runner.architecture
        try:
            out = runner.forward(
                input_ids=view.input_ids.unsqueeze(0),
                position_ids=view.positions.unsqueeze(0),
                use_cache=False,
            )
        finally:
            CURRENT.pool = CURRENT.meta = None
            CURRENT.layers = ()
        return out.logits[0]

    return step
