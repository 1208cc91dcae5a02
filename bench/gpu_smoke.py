"""GPU acceptance check: the engine's CUDA path against transformers and the HBM roofline.

One command on a machine with a CUDA device (about 3-6 minutes on one H100/H200)::

    python bench/gpu_smoke.py                      # everything below
    python bench/gpu_smoke.py --quick              # fidelity + one roofline point (~1 min)
    python bench/gpu_smoke.py --real-model DIR     # another real model than the default one

1. Fidelity, greedy, vs transformers' ``generate()`` on CUDA, tiny model:
   float32 must be token-identical through the Triton back-end (eager and compiled) and
   the gather reference; bfloat16 runs through Triton and every token the engine picks
   must be within ``--bf16-logit-tol`` of the best logit transformers (bfloat16) gives at
   that position, teacher-forced on the engine's tokens (near-ties may flip; errors may
   not). The same bfloat16 check on a real model: the out-of-the-box SmolLM2-135M-Instruct
   (converted from its GGUF file) unless ``--real-model DIR`` names another, or ``none``.
2. Roofline, bfloat16, ``small`` preset, Triton back-end: the median decode step at
   B = 1, 8, 32, 64 and context 512 / 2,048, with CUDA graphs off and on, against
   ``(weight bytes + KV bytes) / HBM bandwidth`` (``roofline_ratio``; goal >= 0.6 at B=32).
3. ``pdserve up`` on CUDA (1 prefill + 1 decode worker) answering the OpenAI client:
   a greedy completion twice, each equal to transformers' greedy text (``up_e2e``).
4. KV hand-off between two processes, each with its CUDA pool: ``bench/kv_transfer.py
   --device cuda`` (a prefill-side pool server and this side's connector; NIXL VRAM to VRAM,
   the tcp fallback through pinned host memory), GB/s for a 4,096-token request of 512 MiB,
   checked byte for byte; plus the same through two NIXL agents in this process.
5. MLA at DeepSeek-V3's latent width (576, one KV head, 128 query heads) on the Triton
   kernels' chunked-width form: 32 decodes of 2,048 tokens against a dense reference
   (float32 and bfloat16), and the bfloat16 call's GB/s of latent read (``mla_latent``).

Prints one JSON line last; exits 1 on any failure (``verdict``): a fidelity check, a
step that raised, the MLA kernel off its reference (``mla_latent``), a KV hand-off whose
bytes differ (``kv_two_processes``, ``nixl_vram``, ``tcp``) and, with ``--hbm-gbps``, a
roofline ratio under 0.6 at B=32 with CUDA graphs. Without CUDA it says so and exits 0
(nothing to check).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lib import flags

from pdserve import env
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy

ROOT = Path(__file__).resolve().parent.parent

# Peak memory bandwidth, GB/s, by device name substring (vendor figures).
HBM_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600, "L4": 300}
MAX_TOKENS = 32
# The tests run the checks' logic on CPU (tests/engine/test_gpu_smoke_script.py) by setting
# this to "cpu"; the script itself always runs on CUDA.
DEVICE = "cuda"


def bandwidth_gbps(name: str, override: float | None) -> float:
    if override:
        return override
    for key, gbps in HBM_GBPS.items():
        if key in name:
            return float(gbps)
    raise SystemExit(f"unknown device {name!r}: pass --hbm-gbps")


def _prompts(n_max: int = 333) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 3000) for _ in range(n)] for n in (1, 17, 64, 200, n_max)]


def _engine(model_dir: Path, dtype: str, backend: str = "", **kw: Any) -> LLMEngine:
    """An engine on CUDA; ``backend`` names the attention back-end (default: by device)."""
    before = os.environ.pop(env.ATTENTION_BACKEND, None)
    if backend:
        os.environ[env.ATTENTION_BACKEND] = backend
    if DEVICE == "cpu":  # the tests: a small pool
        kw.setdefault("kv_cache_bytes", 64 << 20)
    try:
        return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, device=DEVICE, **kw))
    finally:
        os.environ.pop(env.ATTENTION_BACKEND, None)
        if before is not None:
            os.environ[env.ATTENTION_BACKEND] = before


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, [params] * len(prompts))


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _hf(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return model.to(DEVICE).eval()  # type: ignore[arg-type]


def fidelity_fp32(model_dir: Path) -> dict[str, Any]:
    prompts = _prompts()
    hf = _hf(model_dir, torch.float32)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    del hf
    result: dict[str, Any] = {}
    for name, backend, compile_ in (
        ("triton_eager", "triton", False),
        ("triton_compiled", "triton", True),
        ("gather", "gather", False),
    ):
        engine = _engine(model_dir, "float32", backend, compile=compile_)
        got = _greedy(engine, prompts)
        result[name] = {
            "equal": sum(g == w for g, w in zip(got, want, strict=True)),
            "of": len(prompts),
            "kv_free": engine.kv.all_free,
            "backend": engine.runner.attention_backend,
        }
        del engine
    result["ok"] = all(r["equal"] == r["of"] and r["kv_free"] for r in result.values())
    return result


def fidelity_bf16(model_dir: Path, tol: float, prompts: list[list[int]]) -> dict[str, Any]:
    """Each engine token's logit (transformers, teacher-forced) within ``tol`` of the best."""
    engine = _engine(model_dir, "bfloat16", compile=DEVICE == "cuda")
    got = _greedy(engine, prompts)
    backend = engine.runner.attention_backend
    del engine
    hf = _hf(model_dir, torch.bfloat16)
    worst = 0.0
    with torch.inference_mode():
        for p, g in zip(prompts, got, strict=True):
            ids = torch.tensor([p + g[:-1]], device=DEVICE)
            logits = hf(ids).logits[0, len(p) - 1 :].float()  # the positions that chose g
            picked = logits.gather(1, torch.tensor(g, device=DEVICE)[:, None])[:, 0]
            worst = max(worst, float((logits.max(dim=1).values - picked).max()))
    return {"worst_logit_gap": worst, "tol": tol, "ok": worst <= tol, "backend": backend}


def roofline(model_dir: Path, batch: int, context: int, gbps: float, graphs: bool) -> dict:
    pool: dict[str, Any] = {"kv_cache_fraction": 0.5} if DEVICE == "cuda" else {}
    engine = _engine(model_dir, "bfloat16", compile=DEVICE == "cuda", **pool)
    if graphs:
        engine.runner.enable_cuda_graphs()
    rng = random.Random(1)
    for i in range(batch):
        prompt = [rng.randrange(3, 3000) for _ in range(context)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    times = []
    while engine.has_work:
        _sync()
        t = time.perf_counter()
        engine.step()
        _sync()
        times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    s = engine.runner.kv_shape
    kv = batch * (context + 32) * 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2
    bound = (weights + kv) / (gbps * 1e9)
    replays = engine.runner.graphs.replays if engine.runner.graphs else 0
    return {
        "B": batch,
        "ctx": context,
        "graphs": graphs,
        "step_ms": round(step * 1e3, 4),
        "roofline_ms": round(bound * 1e3, 4),
        "roofline_ratio": float(f"{bound / step:.3g}"),
        "graph_replays": replays,
    }


def mla_latent_kernel(
    batch: int = 32,
    ctx: int = 2048,
    heads: int = 128,
    repeats: int = 20,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
) -> dict[str, Any]:
    """DeepSeek-V3's MLA decode at its real latent width on the Triton kernels' chunked-
    width form (``triton_attention._attention``, CHUNKS > 1; proved only under the interpreter
    before a GPU was lent): ``heads`` query heads over one 576-wide latent head that is key
    and value, ``batch`` decodes of ``ctx`` tokens each over scattered blocks. Checked
    against a dense reference (float32 at 1e-4, bfloat16 at 2e-2 of the output's scale),
    and the last dtype's call timed (median of ``repeats``) against the latent bytes it
    must read: ``gbps``. The chunked form recomputes the scores per 64-wide output slice,
    so this figure says what a dedicated MLA kernel would gain. (The tests run it on CPU
    under Triton's interpreter in float32 only: the interpreter's bfloat16 is not the
    GPU's.)"""
    from pdserve.engine import triton_attention as ta

    dev, width, bs = torch.device(DEVICE), 576, 16
    per = -(-ctx // bs)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(batch * per, generator=gen).tolist()
    tables = [order[i * per : (i + 1) * per] for i in range(batch)]
    pool32 = torch.randn((batch * per * bs, 1, width), generator=gen).to(dev)
    q32 = torch.randn((batch, heads, width), generator=gen).to(dev)
    meta = ta.step_metadata([(ctx - 1, 1)] * batch, tables, heads, 1, dev)
    scale = 192**-0.5  # DeepSeek-V3's softmax scale before yarn: (nope 128 + rope 64) ** -0.5
    ref = torch.empty((batch, heads, width), device=dev)
    for i, blocks in enumerate(tables):
        slots = torch.tensor(blocks, device=dev)[:, None] * bs + torch.arange(bs, device=dev)
        latent = pool32[slots.flatten()[:ctx], 0]  # [ctx, width]: key and value
        ref[i] = torch.softmax(q32[i] @ latent.T * scale, dim=-1) @ latent
    result: dict[str, Any] = {"batch": batch, "ctx": ctx, "heads": heads, "width": width}
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
    for dtype in dtypes:
        pool, q, tol = pool32.to(dtype), q32.to(dtype), tolerance[dtype]
        out = torch.empty_like(q)

        def call(q: torch.Tensor = q, pool: torch.Tensor = pool, out: torch.Tensor = out) -> None:
            ta.paged_attention(q, pool, pool, out, meta, bs, scale)

        call()
        _sync()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        result[str(dtype).removeprefix("torch.")] = {"rel_err": err, "ok": err <= tol}
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        call()
        _sync()
        times.append(time.perf_counter() - start)
    ms = sorted(times)[len(times) // 2] * 1e3
    result["step_ms"] = round(ms, 4)
    read = batch * ctx * width * pool.element_size()  # the latent, read once
    result["gbps"] = round(read / ms / 1e6, 3)
    result["ok"] = all(result[str(d).removeprefix("torch.")]["ok"] for d in dtypes)
    return result


def kv_handoff(transport: str, mib: int = 512) -> dict[str, Any]:
    """One request's KV between two CUDA pools through the real transport and lease path."""
    from pdserve.transfer.connector import RemoteKVConnector
    from pdserve.transfer.messages import CompatRecord
    from pdserve.transfer.server import KVServer

    blocks = mib * (1 << 20) // (32 * 2 * 16 * 8 * 128 * 2)  # 32 layers, 8 heads x 128, bf16
    shape = (32, 2, blocks + 8, 16, 8, 128)
    src = torch.randn(shape, device=DEVICE).to(torch.bfloat16)
    dst = torch.zeros_like(src)
    server = KVServer(src, CompatRecord.for_pool(src, "m"), transport=transport)
    conn = RemoteKVConnector(dst, CompatRecord.for_pool(dst, "m"), transport, transfer_timeout=60)
    ids = list(range(blocks))
    try:
        t = time.perf_counter()
        conn.start_load("g", server.make_handle("g", ids, blocks * 16, []), ids, ids)
        while not (results := conn.poll()):
            time.sleep(0.0005)
        elapsed = time.perf_counter() - t
        ok = results[0].ok and torch.equal(dst[:, :, :blocks], src[:, :, :blocks])
    finally:
        conn.close()
        server.close()
    nbytes = src[:, :, :blocks].numel() * 2
    return {"ok": bool(ok), "gbps": round(nbytes / elapsed / 1e9, 2), "bytes": nbytes}


def kv_handoff_processes(quick: bool) -> dict[str, Any]:
    """bench/kv_transfer.py on CUDA pools: the prefill side in its own process."""
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "kv_transfer.py"),
        "--device",
        DEVICE,
        "--plot",
        str(ROOT / "bench" / "out" / f"kv_transfer_{DEVICE}.png"),
    ]
    out = subprocess.run(
        cmd + (["--quick"] if quick else []), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"ok": False, "error": (out.stderr or out.stdout)[-400:]}
    return {"ok": True, **json.loads(lines[-1])}


def real_model_dir(arg: str) -> Path | None:
    """``--real-model``: a directory, ``none``, or (empty) the out-of-the-box model."""
    if arg == "none":
        return None
    if arg:
        return Path(arg)
    from pdserve.engine.model_source import resolve_model

    return Path(resolve_model("", dtype="bfloat16", device=DEVICE))


def hf_text(model_dir: Path, prompt: list[int], max_tokens: int) -> str:
    """transformers' greedy continuation of ``prompt`` (float32, on DEVICE), as text."""
    from transformers import AutoTokenizer

    tokens = hf_greedy(_hf(model_dir, torch.float32), prompt, max_tokens)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return str(tokenizer.decode(tokens))


def up_end_to_end(model_dir: Path, port: int = 8450) -> dict[str, Any]:
    """``pdserve up`` (1 prefill + 1 decode worker on DEVICE, KV over the default
    transport) answering the OpenAI client: greedy, twice, each answer equal to
    transformers' own greedy text for the prompt, all tokens."""
    import serve  # bench/serve.py: starts and stops `pdserve up` as its sweep does
    from openai import OpenAI

    prompt = list(range(5, 300))  # longer than the direct-to-decode threshold
    want = hf_text(model_dir, prompt, 16)
    args = argparse.Namespace(dtype="float32", port=port, worker_arg=[f"--device={DEVICE}"])
    proc, url = serve.start_ours("disagg", str(model_dir), args)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get(env.API_KEY) or "none")
        texts, tokens = [], []
        for _ in range(2):
            out = client.completions.create(
                model=client.models.list().data[0].id,
                prompt=prompt,
                max_tokens=16,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            texts.append(out.choices[0].text)
            tokens.append(out.usage.completion_tokens if out.usage else 0)
    finally:
        serve.stop(proc)
    ok = texts == [want, want] and tokens == [16, 16]
    return {"ok": ok, "completion_tokens": tokens, "equal_to_transformers": texts.count(want)}


def _point(model_dir: Path, b: int, c: int, gbps: float, graphs: bool) -> Callable[[], Any]:
    return lambda: roofline(model_dir, b, c, gbps, graphs)


def _real(arg: str, tol: float) -> dict[str, Any]:
    real = real_model_dir(arg)
    if real is None:
        return {"ok": True, "skipped": "--real-model none"}
    return {"model": real.name, **fidelity_bf16(real, tol, _prompts(120))}


def _guarded(result: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        result[key] = fn()
    except Exception as exc:  # one part failing must not hide the others' figures
        traceback.print_exc()
        result[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    p = flags.parser(__doc__, "fidelity and one roofline point")
    flags.add_options(
        p,
        real_model=(
            "",
            "a local HF model directory (bfloat16); default: the out-of-the-box model "
            "(SmolLM2-135M-Instruct); none: skip",
        ),
        bf16_logit_tol=(
            0.15,
            "the bfloat16 checks' bound: how far below the best logit (transformers, "
            "teacher-forced) each engine token's may be",
        ),
        hbm_gbps=(
            float,
            f"the device's HBM bandwidth, GB/s; given, the roofline goal (ratio >= "
            f"{ROOFLINE_GOAL} at B={ROOFLINE_BATCH}, CUDA graphs on) fails the run when missed",
        ),
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA device: nothing checked"}))
        return 0
    name = torch.cuda.get_device_name()
    gbps = bandwidth_gbps(name, args.hbm_gbps)
    tiny = write_tiny_model(ROOT / ".cache" / "models" / "tiny-seed0", "tiny")
    result: dict[str, Any] = {"cuda": True, "device": name, "hbm_gbps": gbps}
    _guarded(result, "fidelity_fp32", lambda: fidelity_fp32(tiny))
    tol = args.bf16_logit_tol
    _guarded(result, "fidelity_bf16", lambda: fidelity_bf16(tiny, tol, _prompts()))
    _guarded(result, "fidelity_real", lambda: _real(args.real_model, tol))
    small = write_tiny_model(ROOT / ".cache" / "models" / "small-seed0", "small")
    points = [(32, 512)] if args.quick else [(b, c) for c in (512, 2048) for b in (1, 8, 32, 64)]
    result["roofline"] = []
    for b, c in points:
        for graphs in (False, True):
            cell: dict[str, Any] = {}
            _guarded(cell, "r", _point(small, b, c, gbps, graphs))
            result["roofline"].append(cell["r"])
    _guarded(result, "mla_latent", mla_latent_kernel)
    _guarded(result, "up_e2e", lambda: up_end_to_end(tiny))
    _guarded(result, "kv_two_processes", lambda: kv_handoff_processes(args.quick))
    if not args.quick:
        _guarded(result, "nixl_vram", lambda: kv_handoff("nixl"))
        _guarded(result, "tcp", lambda: kv_handoff("tcp"))
    print(json.dumps(result))
    failures = verdict(result, roofline_goal=args.hbm_gbps is not None)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


# Every check whose ``ok`` must hold: fidelity and every KV hand-off (byte for byte).
CHECKS = (
    "fidelity_fp32",
    "fidelity_bf16",
    "fidelity_real",
    "mla_latent",
    "up_e2e",
    "kv_two_processes",
    "nixl_vram",
    "tcp",
)
ROOFLINE_GOAL, ROOFLINE_BATCH = 0.6, 32


def verdict(result: dict[str, Any], roofline_goal: bool) -> list[str]:
    """What failed (empty: the exit is 0). A check that ran and is not ok fails; with
    ``roofline_goal`` (``--hbm-gbps`` given: the bandwidth is known, not looked up) every
    B=32 roofline point with CUDA graphs must reach ROOFLINE_GOAL, and a point that
    raised fails."""
    failures = [f"{k}: {result[k]}" for k in CHECKS if k in result and not result[k].get("ok")]
    if roofline_goal:
        points = result.get("roofline", [])
        failures += [f"roofline point raised: {p}" for p in points if "error" in p]
        goal = [p for p in points if p.get("B") == ROOFLINE_BATCH and p.get("graphs")]
        if not goal and points:
            failures.append(f"roofline: no B={ROOFLINE_BATCH} point with CUDA graphs")
        failures += [
            f"roofline_ratio {p['roofline_ratio']} < {ROOFLINE_GOAL} at B={p['B']} ctx={p['ctx']}"
            for p in goal
            if p["roofline_ratio"] < ROOFLINE_GOAL
        ]
    return failures


if __name__ == "__main__":
    sys.exit(main())
