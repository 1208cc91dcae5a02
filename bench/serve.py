"""Serving benchmark: `pdserve up` under a concurrency sweep, beside any OpenAI-compatible peer.

The load is ``vllm bench serve``'s random dataset (``bench/serve_load.py``): prompts
of ``--input-len`` random token ids, exactly ``--output-len`` output tokens each
(greedy, ignore_eos), streamed. Each configuration of ours is started with
``pdserve up`` on the same model (prefix caching off on both sides: the prompts share
nothing) and stopped after its points:

* ``default``: ``pdserve up`` as shipped (1 prefill + 1 decode worker; the router
  splits prompts over both; threads by its own rules);
* ``colocated``: ``--prefill 0``, one worker that prefills and decodes;
* ``disagg``: the same as ``default``, under its old name;
* ``compile-before-ready``: ``default`` with each worker compiling before it says ready
  (the start-up before issue 43), for ``--setups default compile-before-ready``: the
  background-compiled forward, once swapped in, at the same speed.

``--peer-url URL`` compares one configuration (named before the run: one row) with a
server already running there (vLLM's CPU build, say: see docs/benchmarks.md, "serve"):
``--repeats`` interleaved repetitions at each concurrency (peer first, then ours first, in
turn), and
``peer_ratio`` = the median over repetitions of ours / peer output tok/s at
concurrency 16 (the highest point if 16 is not swept), with ``peer_ratio_range``
(min, max) and each side's median and range. Recorded in the JSON: the peer's model
path and dtype (its ``/v1/models``, else its command line: bench/serve_peer.py), both
sides' thread settings, ``os.getloadavg()`` per repetition. Without ``--peer-url`` each
configuration given runs one sweep. Per point: output tok/s, TTFT and TPOT p50/p99.
Last stdout line: JSON; plot: bench/out/serve.png.

    python bench/serve.py --model-name small --setups default --peer-url http://127.0.0.1:8399
    python bench/serve.py --model default --dtype float32 --setups default --concurrency 16 \
        --peer-url http://127.0.0.1:8399 --peer-name vllm-cpu   # + peer_ratio_default_model
    python bench/serve.py --quick      # tiny model, a few requests (a minute)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import figures  # bench/figures.py, beside this script
import serve_models
from lib import flags
from serve_load import Load, run_point, served_model, warm_up
from serve_peer import describe_peer, ours_threads
from spread import spread

from pdserve.local.proc_group import end_group, start_group

ROOT = Path(__file__).resolve().parent.parent

SETUPS = {
    "default": [],
    "disagg": ["--prefill", "1", "--decode", "1"],
    "colocated": ["--prefill", "0"],
    # The start-up of before issue 43: compiled before ready. Beside ``default`` (compiled in
    # the background, swapped in; measured once every worker's forward is settled) it shows
    # the swapped-in forward serving at the compiled speed.
    "compile-before-ready": ["--worker-arg=--compile-before-ready"],
}
RATIO_AT = 16


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny model, few requests")
    p.add_argument(
        "--model",
        default="",
        help="model directory, or 'default': the model `pdserve up` serves with no --model "
        "(SmolLM2-135M-Instruct, converted for --dtype); empty: --model-name's",
    )
    p.add_argument(
        "--model-name",
        "--preset",
        dest="preset",
        default="tiny",
        choices=serve_models.NAMES,
        help="a preset or a shape of serve_models.py",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=100, help="per concurrency point")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--setups", nargs="+", default=["default", "colocated"], choices=list(SETUPS))
    p.add_argument("--peer-url", default="", help="an OpenAI-compatible server to compare")
    p.add_argument("--peer-name", default="peer")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (--peer-url)")
    p.add_argument("--port", type=int, default=8700, help="router port of our setups")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker argument")
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "serve.png"))
    args = p.parse_args()
    if args.quick:
        args.preset, args.input_len, args.output_len = "tiny", 32, 8
        args.num_prompts, args.concurrency = 8, [1, 4]
    if args.peer_url and len(args.setups) != 1:
        p.error("--peer-url compares one configuration per run (one row): give one --setups")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def model_dir(args: argparse.Namespace) -> str:
    if args.model == serve_models.DEFAULT:
        return serve_models.default_model_dir(args.dtype)
    if args.model:
        return str(args.model)
    return str(serve_models.model_dir(args.preset))


def start_ours(
    setup: str, model: str, args: argparse.Namespace
) -> tuple[subprocess.Popen, str, list[str]]:  # type: ignore[type-arg]
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--model",
        model,
        "--dtype",
        args.dtype,
        "--port",
        str(args.port),
        "--worker-port-base",
        str(args.port + 100),
        "--worker-arg=--no-prefix-caching",
        *SETUPS[setup],
        *(f"--worker-arg={a}" for a in args.worker_arg),
    ]
    # as shipped: the cluster's own core zygote (a caller's, e.g. the test session's, is not
    # the set-up measured; its cores would not be counted under `pdserve up` either)
    environ = {k: v for k, v in os.environ.items() if k != "PDSERVE_CORE_ZYGOTE"}
    proc = start_group(argv, env=environ)
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
    wait_compiled(url, setup, deadline)
    return proc, url, lines


def wait_compiled(url: str, setup: str, deadline: float) -> None:
    """Workers serve eagerly while they compile in the background (engine/compile_job.py):
    measure once every worker's forward is settled (compiled, or eager by choice)."""
    import httpx

    state = ""
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            state = str(httpx.get(url + "/health", timeout=5).json().get("compile", ""))
        if state not in ("compiling", "ready", ""):
            print(f"  [{setup}] workers' forward: {state}", file=sys.stderr)
            return
        time.sleep(1.0)
    raise RuntimeError(f"the workers' compile did not settle (last state {state!r})")


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


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def interleaved(
    peer_url: str, url: str, load: Load, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``--repeats`` rounds of (peer, ours) at each concurrency, the peer first in even
    rounds and second in odd ones: drifting load from other jobs on the host, and whatever
    the first side leaves behind (caches, a busy core), fall on both sides alike."""
    peer_model, model = await served_model(peer_url), await served_model(url)
    await warm_up(peer_url, peer_model, load)
    await warm_up(url, model, load)
    reps = []
    for rep in range(args.repeats):
        first = "peer" if rep % 2 == 0 else "ours"
        for c in args.concurrency:
            before = load_avg()
            if first == "peer":
                peer = await run_point(peer_url, peer_model, load, c)
                ours = await run_point(url, model, load, c)
            else:
                ours = await run_point(url, model, load, c)
                peer = await run_point(peer_url, peer_model, load, c)
            row = {
                "rep": rep,
                "first": first,
                "concurrency": c,
                "peer": peer,
                "ours": ours,
                "ratio": round(ours["output_tok_s"] / peer["output_tok_s"], 3),
                "load_avg_before": before,
                "load_avg_after": load_avg(),
            }
            print(f"  rep {rep} c={c}: {json.dumps(row)}", file=sys.stderr)
            reps.append(row)
    return reps


def summarize_reps(reps: list[dict[str, Any]]) -> dict[str, Any]:
    at = RATIO_AT if any(r["concurrency"] == RATIO_AT for r in reps) else reps[-1]["concurrency"]
    rows = [r for r in reps if r["concurrency"] == at]
    ratio = spread([r["ratio"] for r in rows])
    return {
        "ratio_at_concurrency": at,
        "peer_ratio": ratio["median"],
        "peer_ratio_range": ratio["range"],
        "peer_tok_s": spread([r["peer"]["output_tok_s"] for r in rows]),
        "ours_tok_s": spread([r["ours"]["output_tok_s"] for r in rows]),
        "ours_tpot_p50_ms": spread([r["ours"]["tpot_p50_ms"] for r in rows]),
        "peer_tpot_p50_ms": spread([r["peer"]["tpot_p50_ms"] for r in rows]),
    }


def run_peer_mode(args: argparse.Namespace, model: str, load: Load) -> dict[str, Any]:
    setup = args.setups[0]
    # Named before the run: the one configuration this row measures.
    print(f"configuration: {setup} {' '.join(SETUPS[setup] + args.worker_arg)}", file=sys.stderr)
    peer = asyncio.run(describe_peer(args.peer_url))
    print(
        f"peer {args.peer_name} {args.peer_url}: {peer['model_path']} {peer['dtype']}",
        file=sys.stderr,
    )
    proc, url, lines = start_ours(setup, model, args)
    try:
        ours = ours_threads(proc.pid)
        ours["thread_probe"] = [line.strip() for line in lines if "thread probe:" in line]
        reps = asyncio.run(interleaved(args.peer_url, url, load, args))
    finally:
        stop(proc)
    return {
        "config": setup,
        "config_args": [*SETUPS[setup], *args.worker_arg],
        "peer_name": args.peer_name,
        "peer": peer,
        "ours_threads": ours,
        "repeats": args.repeats,
        "reps": reps,
        **summarize_reps(reps),
    }


def main() -> int:
    args = parse_args()
    model = model_dir(args)
    load = Load(args.num_prompts, args.input_len, args.output_len)
    start_load = load_avg()
    out: dict[str, Any] = {
        "model": Path(model).name,
        "model_path": model,
        "dtype": args.dtype,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "quick": args.quick,
        "bench_torch_threads": os.environ.get("OMP_NUM_THREADS"),
        "cores": len(os.sched_getaffinity(0)),
    }
    results: dict[str, list[dict[str, Any]]] = {}
    if args.peer_url:
        out.update(run_peer_mode(args, model, load))
        if args.model == serve_models.DEFAULT:
            out["peer_ratio_default_model"] = {
                "median": out["peer_ratio"],
                "range": out["peer_ratio_range"],
                "dtype": args.dtype,
                "config": out["config"],
            }
        for side in ("peer", "ours"):  # the last repetition's points, for the plot
            name = args.peer_name if side == "peer" else f"pdserve-{args.setups[0]}"
            last = out["reps"][-1]["rep"]
            results[name] = [r[side] for r in out["reps"] if r["rep"] == last]
    for setup in [] if args.peer_url else args.setups:
        proc, url, _ = start_ours(setup, model, args)
        try:
            results[f"pdserve-{setup}"] = asyncio.run(sweep(setup, url, load, args.concurrency))
            out.setdefault("ours_threads", {})[setup] = ours_threads(proc.pid)
        finally:
            stop(proc)
    out.update(results=results, load_avg_start=start_load, load_avg_end=load_avg())
    title = (
        f"{Path(model).name}, {args.dtype}, random {args.input_len} in / {args.output_len} "
        f"out, {args.num_prompts} prompts per point, load avg {start_load[0]}"
    )
    plot(args.plot, results, title)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
