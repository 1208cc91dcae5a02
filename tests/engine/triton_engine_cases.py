"""The three attention back-ends through the engine's own attention call, and a whole
model through the Triton back-end; run as a script under Triton's interpreter.

``python tests/engine/triton_engine_cases.py MODEL_DIR [LATENT_MODEL_DIR]`` (MODEL_DIR: a
small llama, the llama family's tiny model in the suite)
(``TRITON_INTERPRET=1`` set before triton is imported) prints one JSON line:

* ``backends``: per case (layer options x GQA), the largest difference of the Triton and
  the CPU kernel outputs from the gather path's, on one step that mixes decodes, a
  continuing prefill chunk and a chunk that starts its request, over scattered blocks;
* ``kernels``: triton_cases.py's kernel cases (case id -> largest difference);
* ``model``: greedy tokens of the model through the Triton back-end (chunked prefill
  beside decodes) against transformers' generate(), and whether every block came back;
* ``latent``: a tiny DeepSeek-V3 at MLA's real latent width (576) through the Triton
  back-end's chunked-width kernel, against transformers and the gather path;
* ``gpu_smoke_mla``: bench/gpu_smoke.py's MLA kernel check, on the kernel and on a wrong one.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton_cases
from step_cases import BS, bare_runner, mixed_chunks

from pdserve.engine import attention as A
from pdserve.engine import attention_backends as ab
from pdserve.engine.kv_pool import KVPool, KVShape
from pdserve.engine.model_support import LayerAttention
from pdserve.engine.sched_output import ScheduledChunk
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy

OPTIONS = {
    "plain": LayerAttention(),
    "window": LayerAttention(window=40),
    "softcap-sinks": LayerAttention(softcap=20.0, sinks=True),
}


def backend_case(hq: int, hkv: int, opts: LayerAttention, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    d = 32
    shape = KVShape(1, hkv, d, BS, torch.float32)
    history = torch.randn((1, 2, 64, BS, hkv, d))
    chunks = mixed_chunks(rng, 64)
    t = sum(c.num_tokens for c in chunks)
    q = torch.randn(1, t, hq, d).transpose(1, 2)  # as transformers hands it over
    k, v = torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    sinks = torch.randn(hq) if opts.sinks else None
    outs, pools = {}, {}
    for backend in (ab.GATHER, ab.TRITON, ab.CPU):
        pool = KVPool(shape, 64, torch.device("cpu"))
        pool.tensor.copy_(history)
        runner = bare_runner(pool, backend, hq)
        A.CURRENT.pool = pool
        A.CURRENT.meta = runner._metadata(chunks, runner._flatten(chunks)[2])
        A.CURRENT.layers, A.CURRENT.architecture = (opts,), "test"
        try:
            outs[backend] = A._attend(q, k, v, 0, d**-0.5, sinks)
        finally:
            A.CURRENT.pool = A.CURRENT.meta = None
            A.CURRENT.layers = ()
        pools[backend] = pool.tensor
    ref = outs[ab.GATHER]
    result = {b: float((outs[b] - ref).abs().max()) for b in (ab.TRITON, ab.CPU)}
    # The same new K/V written by every back-end: a difference is infinite.
    same = all(torch.equal(pools[b], pools[ab.GATHER]) for b in pools)
    return result if same else {b: float("inf") for b in result}


def model_case(model_dir: Path) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 3000) for _ in range(n)] for n in (1, 17, 40, 70)]
    max_tokens = 6
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p, max_tokens) for p in prompts]
    # A small token budget: prefill chunks continue their context beside decodes.
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=64 * 32768,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, [params] * len(prompts))
    return {
        "backend": engine.runner.attention_backend,
        "equal": sum(g == w for g, w in zip(got, want, strict=True)),
        "of": len(prompts),
        "kv_free": engine.kv.all_free,
    }


def latent_case(model_dir: Path) -> dict[str, object]:
    """A tiny DeepSeek-V3 at MLA's real latent width (512 + 64: the pool's one 576-wide
    head, the chunked-width kernel) through the Triton back-end: greedy tokens against
    transformers' generate() and against the engine on the gather path; two short
    prompts (a block and part of one; the interpreter runs each 64-wide slice's program:
    triton_cases.py's wide cases mix prefill chunks and decodes in one step)."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 3000) for _ in range(n)] for n in (5, 20)]
    max_tokens = 3
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    want = [hf_greedy(hf, p, max_tokens) for p in prompts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * 2
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=4 << 20,
        enable_prefix_caching=False,
    )
    got: dict[str, list[list[int]]] = {}
    backends = []
    for backend in (ab.TRITON, ab.GATHER):
        engine = LLMEngine(config)
        if backend == ab.GATHER:
            engine.runner.attention_backend, engine.runner.use_kernel = ab.GATHER, False
        backends.append(engine.runner.attention_backend)
        got[backend] = engine.generate(prompts, params)
        assert engine.kv.all_free
    latent = engine.runner.latent
    return {
        "backends": backends,
        "head_dim": engine.runner.head_dim,
        "latent": [latent.kv_lora_rank, latent.rope_dim] if latent else None,
        "triton_equal": sum(g == w for g, w in zip(got[ab.TRITON], want, strict=True)),
        "gather_equal": sum(g == w for g, w in zip(got[ab.GATHER], want, strict=True)),
        "of": len(prompts),
    }


def gpu_smoke_mla_case() -> dict[str, object]:
    """bench/gpu_smoke.py's MLA kernel check (the GPU day's: DeepSeek's 576-wide latent,
    key = value), its logic on CPU at a tiny size, float32 (the interpreter's bfloat16 is
    not the GPU's): on the kernel, and on a kernel made wrong (the scores summed over 8 of
    the latent's 9 slices), which the check must fail."""
    import gpu_smoke

    from pdserve.engine import triton_attention as ta

    gpu_smoke.DEVICE = "cpu"
    small: dict[str, Any] = {"batch": 2, "ctx": 40, "heads": 4, "repeats": 1}
    good = gpu_smoke.mla_latent_kernel(**small, dtypes=(torch.float32,))
    kernel = ta.paged_attention

    def last_slice_dropped(q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        rope_zeroed = torch.cat((q[..., :512], torch.zeros_like(q[..., 512:])), -1)
        kernel(rope_zeroed, *args, **kwargs)

    ta.paged_attention = last_slice_dropped  # type: ignore[assignment]
    try:
        bad = gpu_smoke.mla_latent_kernel(**small, dtypes=(torch.float32,))
    finally:
        ta.paged_attention = kernel  # type: ignore[assignment]
    return {"good": good, "bad": bad}


class FakeGraphRunner:
    """No CUDA here (a mock, where the real thing cannot run): "replay" re-runs the
    captured step, which reads the static input tensors only."""

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        step()
        return step


def graphs_case(model_dir: Path) -> dict[str, object]:
    """One decode step of 3 requests, eager and through the graphs' static inputs padded
    to bucket 4: the same logits."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=64 * 32768,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 20, 40)):  # the next position stays inside an allocated block
        engine.add_request(f"g{i}", [7 + i] * n, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    chunks = [ScheduledChunk.of(r, 1) for r in engine.requests.values()]
    runner = engine.runner
    eager = runner.execute(chunks)
    runner.enable_cuda_graphs(FakeGraphRunner(), buckets=(2, 4))
    replayed = runner.execute(chunks)
    assert runner.graphs is not None
    return {
        "max_diff": float((replayed - eager).abs().max()),
        "replays": runner.graphs.replays,
        "rows": int(replayed.shape[0]),
    }


def main() -> int:
    from pdserve.engine import triton_attention

    assert triton_attention.interpreted(), "set TRITON_INTERPRET=1 before triton is imported"
    triton_cases.skip_discarded_overflow_checks()
    backends = {}
    for seed, (name, opts) in enumerate(OPTIONS.items()):
        for hq, hkv in ((4, 2), (4, 4), (8, 2)):
            backends[f"{name}-gqa{hq // hkv}"] = backend_case(hq, hkv, opts, seed)
    # The kernel cases too (triton_cases.py): one interpreter start (torch, triton) for both.
    result: dict[str, object] = {"backends": backends, "kernels": triton_cases.kernel_errors()}
    if len(sys.argv) > 1:
        result["model"] = model_case(Path(sys.argv[1]))
        result["graphs"] = graphs_case(Path(sys.argv[1]))
    if len(sys.argv) > 2:
        result["latent"] = latent_case(Path(sys.argv[2]))
        result["gpu_smoke_mla"] = gpu_smoke_mla_case()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
