"""The baselines of bench/engine.py: transformers' own continuous batching, and static batches.

* ``run_continuous``: transformers' continuous-batching manager (``generation/
  continuous_batching``: paged KV cache, a FIFO scheduler admitting requests as others
  finish, chunked prefill up to ``max_batch_tokens``), every request added at once with
  its own ``max_new_tokens``, greedy, no EOS: the headline baseline (issue 28 item 4). Its
  pages hold as many tokens as our blocks, its cache the same bytes, its batches the same
  token budget and request count as ours; it runs the model's eager forward (transformers'
  default for it: ``default_compile_level=0``) with SDPA (no flash attention on CPU).
* ``run_static``: ``model.generate()`` on static batches of left-padded prompts, each run
  to its longest output: the padding-bound figure of earlier runs, kept as a second row.

Both return a ``Run`` (wall and CPU seconds, a timeline of finished output tokens).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm


@dataclass
class Run:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time (all its threads)
    forward_seconds: float = 0.0
    attention_seconds: float = 0.0  # inside forward: paged attention, KV writes and copies
    kv_copy_seconds: float = 0.0  # inside attention: gathers of pool blocks (gather path)
    steps: int = 0
    kv_waste: float = 0.0
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (s, output tokens)


@dataclass(frozen=True)
class CacheShape:
    """Our engine's KV budget, for the baseline's paged cache."""

    block_size: int
    kv_cache_bytes: int
    max_batch_tokens: int
    max_requests: int


def _block_bytes(model: Any, block_size: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.tensor([], dtype=model.dtype).element_size()
    return block_size * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem


def run_continuous(
    model: Any, prompts: list[list[int]], output_lens: list[int], shape: CacheShape
) -> Run:
    """Every request through transformers' continuous-batching manager; each finishes
    after exactly its own output length (EOS disabled)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(output_lens)
    )
    cb = ContinuousBatchingConfig(
        page_size=shape.block_size,
        num_blocks=max(1, shape.kv_cache_bytes // _block_bytes(model, shape.block_size)),
        max_batch_tokens=shape.max_batch_tokens,
        max_requests_per_batch=shape.max_requests,
        allow_block_sharing=False,  # random prompts share nothing; ours runs without either
        auto_switch_to_flash=False,
    )
    run = Run()
    total = sum(output_lens)
    done, finished = 0, 0
    bar = tqdm(total=total, desc="transformers CB", unit="tok", file=sys.stderr)
    with (
        torch.inference_mode(),
        model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
        ) as manager,
    ):
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, (prompt, n) in enumerate(zip(prompts, output_lens, strict=True)):
            manager.add_request(prompt, request_id=f"b{i}", max_new_tokens=n)
        while finished < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers CB request {result.request_id}: {result.error}")
            n = len(result.generated_tokens)
            expected = output_lens[int(result.request_id[1:])]
            assert n == expected, (result.request_id, n, expected)
            done += n
            finished += 1
            bar.update(n)
            run.timeline.append((time.perf_counter() - start, done))
        run.seconds = time.perf_counter() - start
        run.cpu_seconds = time.process_time() - cpu_start
    bar.close()
    assert done == total, (done, total)
    return run


def run_static(
    model: Any,
    pad_id: int,
    prompts: list[list[int]],
    output_lens: list[int],
    batch: int,
    device: str,
) -> Run:
    """Static batches of ``batch`` left-padded prompts, each run to its longest output."""
    run = Run()
    order = list(range(len(prompts)))
    batches = [order[i : i + batch] for i in range(0, len(order), batch)]
    done = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for idx in tqdm(batches, desc="transformers static", unit="batch", file=sys.stderr):
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            n = len(prompts[i])
            ids[row, width - n :] = torch.tensor(prompts[i])
            mask[row, width - n :] = 1
        new = max(output_lens[i] for i in idx)  # a static batch runs to its longest
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == width + new
        done += sum(output_lens[i] for i in idx)
        run.steps += new
        run.timeline.append((time.perf_counter() - start, done))
    run.seconds = time.perf_counter() - start
    run.cpu_seconds = time.process_time() - cpu_start
    return run


def warm_up_continuous(model: Any, shape: CacheShape) -> None:
    """One short request through the manager first, as ours gets one."""
    run_continuous(model, [[5] * 40], [4], shape)
