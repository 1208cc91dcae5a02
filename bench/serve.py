"""Serving benchmark: `pdserve up` under a concurrency sweep, beside any OpenAI-compatible peer.

The load is ``vllm bench serve``'s random dataset (``bench/serve_load.py``): prompts
of ``--input-len`` random token ids, exactly ``--output-len`` output tokens each
(greedy, ignore_eos), streamed. Each setup of ours is started with ``pdserve up``
on the same model and stopped after its sweep:

* ``disagg``: 1 prefill + 1 decode worker (the router splits prompts over both);
* ``colocated``: ``--prefill 0``, one worker that prefills and decodes.

``--peer-url URL`` runs the identical sweep against a server already running there
(vLLM's CPU build, say: see README "Serving benchmark") in the same run, and
reports ``peer_ratio``: ours / peer output tok/s at concurrency 16 (the best of our
setups; each setup's ratio is in ``peer_ratios``). Per point: output tok/s, TTFT and
TPOT p50/p99. Last stdout line: JSON; plot: bench/out/serve.png.

    python bench/serve.py --preset small --dtype float32 --peer-url http://127.0.0.1:8300
    python bench/serve.py --quick      # tiny model, a few requests (a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script

from pdserve.local.proc_group import end_group

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from serve_load import Load, run_point, served_model, warm_up  # noqa: E402

SETUPS = {"disagg": ["--prefill", "1", "--decode", "1"], "colocated": ["--prefill", "0"]}
RATIO_AT = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few requests")
    p.add_argument("--model", default="", help="model directory (default: the --preset model)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=100, help="per concurrency point")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--peer-url", default="", help="an OpenAI-compatible server to compare")
    p.add_argument("--peer-name", default="peer")
    p.add_argument("--port", type=int, default=8700, help="router port of our setups")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument")
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "serve.png"))
    args = p.parse_args()
    if args.quick:
        args.preset, args.input_len, args.output_len = "tiny", 32, 8
        args.num_prompts, args.concurrency = 8, [1, 4]
    return args


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from pdserve.engine.tiny_model import write_tiny_model

    out = ROOT / ".cache" / "models" / f"{args.preset}-seed0"
    return str(write_tiny_model(out, args.preset))


def start_ours(setup: str, model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    argv = [sys.executable, "-m", "pdserve", "up", "--model", model, "--dtype", args.dtype,
            "--port", str(args.port), "--worker-port-base", str(args.port + 100),
            "--worker-arg=--no-prefix-caching", *SETUPS[setup],
            *(f"--worker-arg={a}" for a in args.worker_arg)]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + 600
    assert proc.stdout is not None
    while not any(line.startswith("pdserve is up") for line in lines):
        line = proc.stdout.readline()
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError("pdserve up did not come up:\n" + "".join(lines[-30:]))
        lines.append(line)
        print(f"  [{setup}] {line.rstrip()}", file=sys.stderr)
    url = re.search(r"pdserve is up: (\S+)/v1", "".join(lines)).group(1)  # type: ignore[union-attr]
    return proc, url


def stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    end_group(proc, grace_s=60)


async def sweep(name: str, url: str, load: Load, concurrency: list[int]) -> list[dict[str, Any]]:
    model = await served_model(url)
    await warm_up(url, model, load)
    points = []
    for c in concurrency:
        point = await run_point(url, model, load, c)
        print(f"  {name:>10} c={c:<3} {json.dumps(point)}", file=sys.stderr)
        points.append(point)
    return points


def tok_s_at(points: list[dict[str, Any]], concurrency: int) -> float | None:
    for p in points:
        if p["concurrency"] == concurrency:
            return float(p["output_tok_s"])
    return None


def ratios(results: dict[str, list[dict[str, Any]]], peer: str) -> dict[str, float]:
    at = RATIO_AT if tok_s_at(results[peer], RATIO_AT) else results[peer][-1]["concurrency"]
    base = tok_s_at(results[peer], at) or float("nan")
    return {
        name: round((tok_s_at(points, at) or float("nan")) / base, 3)
        for name, points in results.items()
        if name != peer
    }


def plot(path: str, results: dict[str, list[dict[str, Any]]], title: str) -> None:
    plt = figures.pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, points in results.items():
        xs = [p["concurrency"] for p in points]
        axes[0].plot(xs, [p["output_tok_s"] for p in points], marker="o", label=name)
        axes[1].plot(xs, [p["tpot_p50_ms"] for p in points], marker="o", label=name)
        axes[2].plot(xs, [p["ttft_p50_ms"] for p in points], marker="o", label=name)
    for ax, label in zip(axes, ["output tok/s", "TPOT p50 (ms)", "TTFT p50 (ms)"], strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    figures.save(fig, path, dpi=110)


def main() -> int:
    args = parse_args()
    model = model_dir(args)
    load = Load(args.num_prompts, args.input_len, args.output_len)
    results: dict[str, list[dict[str, Any]]] = {}
    load_avg = [round(x, 2) for x in os.getloadavg()]
    if args.peer_url:
        print(f"peer {args.peer_url}", file=sys.stderr)
        results[args.peer_name] = asyncio.run(sweep(args.peer_name, args.peer_url, load,
                                                    args.concurrency))  # fmt: skip
    for setup in args.setups:
        proc, url = start_ours(setup, model, args)
        try:
            results[f"pdserve-{setup}"] = asyncio.run(sweep(setup, url, load, args.concurrency))
        finally:
            stop(proc)
    out: dict[str, Any] = {"results": results, "model": Path(model).name, "dtype": args.dtype,
                           "input_len": args.input_len, "output_len": args.output_len,
                           "num_prompts": args.num_prompts, "quick": args.quick,
                           "load_avg_start": load_avg,
                           "load_avg_end": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    if args.peer_url:
        out["peer_ratios"] = ratios(results, args.peer_name)
        out["peer_ratio"] = max(out["peer_ratios"].values())
    title = (f"{Path(model).name}, {args.dtype}, random {args.input_len} in / {args.output_len} "
             f"out, {args.num_prompts} prompts per point, load avg {load_avg[0]}")  # fmt: skip
    plot(args.plot, results, title)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
