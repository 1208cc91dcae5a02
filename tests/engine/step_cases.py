"""One engine step built by hand, for the attention back-end tests (test_cpu_kernel.py and
triton_engine_cases.py): a bare ModelRunner over a pool, and a step that mixes decodes, a
continuing prefill chunk and a chunk that starts its request, over scattered blocks."""

from __future__ import annotations

import random

import torch

from pdserve.engine import attention_backends as ab
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sched_output import ScheduledChunk
from pdserve.protocol.sampling_params import SamplingParams

BS = 16


class OneLayer(torch.nn.Module):
    """What the attention call reads of its module: the layer index."""

    layer_idx = 0


def bare_runner(pool: KVPool, backend: str, hq: int = 0) -> ModelRunner:
    """A ModelRunner with no model: just what building a step's metadata reads."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.dtype = BS, torch.device("cpu"), pool.shape.dtype
    runner.num_layers, runner.num_kv_heads = 1, pool.shape.num_kv_heads
    runner.head_dim, runner.decode_group_rows = pool.shape.head_dim, 8
    runner._gather_buffer, runner.pool = None, pool
    runner.attention_backend, runner.use_kernel = backend, backend == ab.CPU
    runner.hf_config = type("Config", (), {"num_attention_heads": hq})()
    return runner


def mixed_chunks(rng: random.Random, num_blocks: int) -> list[ScheduledChunk]:
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks = []
    # (context before the step, tokens this step): decodes, a continuing chunk, a fresh one
    steps = [(0, 1), (1, 1), (15, 1), (16, 1), (200, 1), (77, 1), (40, 23), (0, 30)]
    for i, (done, n) in enumerate(steps):
        total = done + n
        req = Request(f"r{i}", [5] * total, SamplingParams())
        req.block_ids = [free.pop() for _ in range(-(-total // BS))]
        req.num_computed_tokens = done
        chunks.append(ScheduledChunk.of(req, n))
    return chunks
