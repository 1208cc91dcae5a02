"""The model runner's step inputs: flattened tokens, slots, decode groups.

These build tensors only; the forward pass itself is covered by test_fidelity.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.model_runner import DECODE_GROUP_SHARE, ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sched_output import ScheduledChunk
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 16


def _runner() -> ModelRunner:
    """A runner without a model: only the input builders are used."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.dtype = BS, torch.device("cpu"), torch.float32
    runner.num_layers, runner.num_kv_heads, runner.head_dim = 2, 2, 8
    runner.decode_group_rows = 8
    runner.use_kernel = False  # the gather path's decode groups are tested here
    runner._gather_buffer = None
    return runner


def _request(rid: str, prompt_len: int, outputs: int, blocks: list[int]) -> Request:
    req = Request(rid, [1000 + i for i in range(prompt_len)], SamplingParams())
    req.output_token_ids = [5000 + i for i in range(outputs)]
    req.block_ids = blocks
    return req


def test_flatten_positions_slots_and_sample_rows() -> None:
    runner = _runner()
    a = _request("a", 40, 0, [7, 3, 9])  # a prefill chunk from token 20 to 36
    a.num_computed_tokens = 20
    b = _request("b", 10, 6, [4, 12])  # a decode of token 15 (an output token)
    b.num_computed_tokens = 15
    chunks = [ScheduledChunk.of(a, 16), ScheduledChunk.of(b, 1)]
    assert not chunks[0].samples and chunks[1].samples
    ids, pos, slots, rows = runner._flatten(chunks)
    assert ids.tolist() == [1000 + i for i in range(20, 36)] + [5005]
    assert pos.tolist() == [*range(20, 36), 15]
    want = [[7, 3, 9][p // BS] * BS + p % BS for p in range(20, 36)] + [4 * BS + 15]
    assert slots.tolist() == want
    assert rows.tolist() == [16]


def test_decode_groups_cover_every_row_once_with_bounded_padding() -> None:
    runner = _runner()
    rng = random.Random(3)
    decodes = []
    for row in range(37):
        ctx = rng.randint(1, 700)
        decodes.append((row, list(range(100 * row, 100 * row + -(-ctx // BS))), ctx))
    groups = runner._decode_groups(decodes)
    seen = [r for g in groups for r in g.rows.tolist()]
    assert sorted(seen) == list(range(37))
    by_row = {row: (blocks, ctx) for row, blocks, ctx in decodes}
    for g in groups:
        assert len(g.rows) <= runner.decode_group_rows
        width = g.block_table.shape[1]
        for k, row in enumerate(g.rows.tolist()):
            blocks, ctx = by_row[row]
            assert len(blocks) >= width * DECODE_GROUP_SHARE
            assert g.block_table[k, : len(blocks)].tolist() == blocks
            assert g.mask[k, 0, 0].tolist() == [i < ctx for i in range(width * BS)]


def test_prefill_metadata_gathers_only_for_later_chunks() -> None:
    runner = _runner()
    first = _request("first", 50, 0, [1, 2, 3, 4])
    later = _request("later", 50, 0, [5, 6, 7, 8])
    later.num_computed_tokens = 32  # a prefix-cache hit or an earlier chunk
    chunks = [ScheduledChunk.of(first, 50), ScheduledChunk.of(later, 18)]
    meta = runner._metadata(chunks, torch.zeros(68, dtype=torch.long))
    own, gathered = meta.prefills
    assert own.block_table is None and (own.start, own.num_tokens) == (0, 50)
    assert gathered.block_table is not None and gathered.block_table.tolist() == [5, 6, 7, 8]
    assert gathered.context_len == 50 and gathered.causal_mask is not None
    assert gathered.causal_mask.shape == (18, 50)
    assert gathered.causal_mask[0].sum() == 33 and gathered.causal_mask[-1].all()
    assert meta.k_buffer is not None and meta.k_buffer.shape[0] >= 4
    assert not meta.decodes
