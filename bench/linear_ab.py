"""Two linear-layer rules in one engine: prefill and decode steps, swapped every two.

An A/B of ``cpu_linear.blas_only`` (a float32 weight kept input-major, no packed copy, every
call multiplied by BLAS) on a real model, in one process so both sides share the host's
load: every float32 weight in its range (2^19 to 2^21 elements: SmolLM2's MLP) BLAS-only, as
on an Intel CPU, against the same weights packed for oneDNN, as elsewhere. One ``LLMEngine``
(transformers' forward with the compiled path's linear layers, ``--eager --pack`` in
engine_profile's terms: no compile wait); each of those weights holds both layouts and the
rule is switched every two steps. Each round (the first warms up, untimed) adds ``--batch``
greedy requests of ``--prompt-len`` random ids, times the prefill steps (``--chunk`` tokens
a step), then ``--steps`` decode steps at ``--batch`` rows. CPU time of the engine thread
(``time.thread_time``). Last stdout line: JSON with ``prefill_blas_over_packed`` and
``decode_blas_over_packed`` (medians of CPU per prompt token / per decode step).

    python bench/linear_ab.py                 # SmolLM2, float32
    python bench/linear_ab.py --quick         # fewer rounds and steps
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from lib import flags
from serve_models import default_model_dir

from pdserve.engine import cpu_linear
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

RULES = ("packed", "blas")


def parse_args() -> Any:
    p = flags.parser(__doc__, "2 rounds of 8 x 256 in chunks of 512, 8 decode steps")
    flags.add_ints(p, batch=16, prompt_len=256, steps=16, rounds=4, chunk=2048)
    args = p.parse_args()
    if args.quick:
        args.batch, args.steps, args.rounds, args.chunk = 8, 8, 2, 512
    return args


Layer = tuple[Any, torch.Tensor, torch.Tensor]  # layer, packed, input-major


def packed_everywhere(model: torch.nn.Module) -> list[Layer]:
    """``cpu_linear.prepare`` with no weight BLAS-only; returns the float32 layers of
    ``SMALL_GEMM_MACS`` up to ``BLAS_ONLY_ELEMENTS`` elements (the range of
    ``cpu_linear.blas_only``, whatever this CPU), each with its packed weight and an
    input-major copy."""
    rule = cpu_linear.blas_only
    cpu_linear.blas_only = lambda weight, mode: False  # type: ignore[assignment]
    try:
        cpu_linear.prepare(model)
    finally:
        cpu_linear.blas_only = rule  # type: ignore[assignment]
    out = []
    for layer in model.modules():
        if not isinstance(layer, cpu_linear.PackedLinear) or layer.packed is None:
            continue
        n = layer.in_features * layer.out_features
        if layer.shared is not None or layer.packed.dtype != torch.float32:
            continue
        if not cpu_linear.SMALL_GEMM_MACS <= n <= cpu_linear.BLAS_ONLY_ELEMENTS:
            continue
        dense = torch.empty(layer.in_features, layer.out_features)
        eye = torch.eye(layer.in_features)  # oneDNN on the identity: the weight back
        dense.copy_(torch.ops.mkldnn._linear_pointwise(eye, layer.packed, None, "none", [], ""))
        out.append((layer, layer.packed, dense))
    return out


def use(rule: str, layers: list[Layer]) -> None:
    for layer, packed, dense in layers:
        layer.packed, layer.blas = (None, dense.t()) if rule == "blas" else (packed, None)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(
        model=default_model_dir("float32"),
        dtype="float32",
        cpu_threads=1,
        compile=False,
        enable_prefix_caching=False,
        kv_cache_bytes=512 << 20,
        max_num_batched_tokens=args.chunk,
    )
    engine = LLMEngine(config)
    layers = packed_everywhere(engine.runner.model)
    rng = random.Random(0)
    top = min(engine.vocab_size, len(engine.tokenizer)) - 1
    prefill: dict[str, list[float]] = {r: [] for r in RULES}
    decode: dict[str, list[float]] = {r: [] for r in RULES}
    n = 0
    for rnd in range(args.rounds):
        params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            ids = [rng.randint(3, top) for _ in range(args.prompt_len)]
            engine.add_request(f"r{rnd}-{i}", ids, params)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            rule = RULES[(n // 2) % 2]
            use(rule, layers)
            before = sum(r.num_computed_tokens for r in engine.requests.values())
            start = time.thread_time()
            engine.step()
            spent = time.thread_time() - start
            done = sum(r.num_computed_tokens for r in engine.requests.values()) - before
            if rnd > 0:  # round 0 warms up: oneDNN builds its primitives
                prefill[rule].append(spent / max(1, done))
            n += 1
        for i in range(args.steps):
            rule = RULES[(i // 2) % 2]
            use(rule, layers)
            start = time.thread_time()
            engine.step()
            if rnd > 0:
                decode[rule].append(time.thread_time() - start)
        while engine.has_work:
            engine.step()
    out: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "layers": len(layers)}
    for rule in RULES:
        out[rule] = {
            "prefill_cpu_ms_per_token": round(statistics.median(prefill[rule]) * 1e3, 4),
            "decode_step_cpu_ms": round(statistics.median(decode[rule]) * 1e3, 2),
            "prefill_steps": len(prefill[rule]),
            "decode_steps": len(decode[rule]),
        }
    for key, field in (("prefill", "prefill_cpu_ms_per_token"), ("decode", "decode_step_cpu_ms")):
        out[f"{key}_blas_over_packed"] = round(out["blas"][field] / out["packed"][field], 3)
    out["load_avg"] = os.getloadavg()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
