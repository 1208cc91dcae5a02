"""GPU smoke check: the engine's CUDA paths against transformers and the HBM roofline.

Run where a CUDA device is present (the `device` machine when it is lent):

    python bench/gpu_smoke.py                 # small preset; --preset tiny for seconds

1. Fidelity: greedy outputs of the engine (gather attention, compiled forward and eager)
   equal transformers' ``generate()`` on CUDA, float32, for a fixed prompt set.
2. Roofline: a decode step of B requests at context C reads every weight once and
   every request's KV once; at the device's memory bandwidth that takes
   ``(weight bytes + KV bytes) / bandwidth``. Prints the measured decode step time and
   ``roofline_ratio`` = roofline time / measured time (1.0 is the bound), bfloat16.

Prints one JSON line last. Without CUDA it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.engine.tiny_model import write_tiny_model  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402

# Peak memory bandwidth, GB/s, by device name substring (vendor figures).
HBM_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600, "L4": 300}


def bandwidth_gbps(name: str, override: float | None) -> float:
    if override:
        return override
    for key, gbps in HBM_GBPS.items():
        if key in name:
            return float(gbps)
    raise SystemExit(f"unknown device {name!r}: pass --hbm-gbps")


def fidelity(model_dir: Path, compile_: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 3000) for _ in range(n)] for n in (1, 17, 64, 200, 333)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    want = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p], device="cuda"), max_new_tokens=32, min_new_tokens=32,
                do_sample=False, eos_token_id=None, pad_token_id=hf.config.pad_token_id,
            )  # fmt: skip
            want.append(out[0, len(p) :].tolist())
    del hf
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cuda", compile=compile_)
    engine = LLMEngine(config)
    got = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    equal = sum(g == w for g, w in zip(got, want, strict=True))
    free = engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return {"equal": equal, "of": len(prompts), "kv_free": free}


def roofline(model_dir: Path, batch: int, context: int, gbps: float) -> dict[str, Any]:
    config = EngineConfig(model=str(model_dir), dtype="bfloat16", device="cuda", compile=True)
    engine = LLMEngine(config)
    rng = random.Random(1)
    for i in range(batch):
        prompt = [rng.randrange(3, 3000) for _ in range(context)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    times = []
    while engine.has_work:
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    s = engine.runner.kv_shape
    kv_per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2  # K and V, bf16
    kv = batch * (context + 32) * kv_per_token  # the median step's context
    bound = (weights + kv) / (gbps * 1e9)
    return {"decode_step_ms": step * 1e3, "roofline_ms": bound * 1e3,
            "roofline_ratio": bound / step, "weight_bytes": weights, "kv_bytes": kv}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--hbm-gbps", type=float, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA device: nothing checked"}))
        return 0
    name = torch.cuda.get_device_name()
    model_dir = write_tiny_model(ROOT / ".cache" / "models" / f"{args.preset}-seed0", args.preset)
    result: dict[str, Any] = {"cuda": True, "device": name, "preset": args.preset}
    result["fidelity_eager"] = fidelity(model_dir, compile_=False)
    result["fidelity_compiled"] = fidelity(model_dir, compile_=True)
    gbps = bandwidth_gbps(name, args.hbm_gbps)
    result.update(roofline(model_dir, args.batch, args.context, gbps), hbm_gbps=gbps)
    print(json.dumps(result))
    ok = result["fidelity_eager"]["equal"] == result["fidelity_eager"]["of"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
