"""Where `pdserve up`'s CPU goes under bench/serve.py's load: CPU seconds per process and per
thread, per output token.

Starts one configuration of bench/serve.py (``--setups``) on a model, waits for the workers'
forward to settle, warms up, then runs one point of the serve load (random ``--input-len``
in / ``--output-len`` out, ``--num-prompts`` at ``--concurrency``) and reads every process's
and thread's CPU time (/proc, utime + stime) before and after. On a loaded host wall figures
mean little; CPU time per output token is what one process costs the others on a shared
core. The load's client runs in this process and is reported apart.

Last stdout line: JSON with ``per_process`` (role, CPU-s, CPU-ms per output token, and the
threads over 2% of it) and ``point`` (bench/serve_load.py's summary: wall figures, with the
load average beside them).

    python bench/serve_cpu.py --model-name tiny
    python bench/serve_cpu.py --model-name wide-vocab --setups colocated
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import serve
import serve_models
from lib.procfs import cpu_seconds, descendants
from serve_load import Load, run_point, served_model, warm_up


def role(argv: list[str]) -> str:
    text = " ".join(argv)
    for key in ("router", "prefill", "decode", "zygote"):
        if key in text:
            return key
    return Path(argv[0]).name if argv else "?"


def snapshot(root: int) -> dict[tuple[int, int], tuple[str, str, float]]:
    """(pid, tid) -> (process role, thread name, CPU seconds), for the tree under ``root``."""
    out: dict[tuple[int, int], tuple[str, str, float]] = {}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            name = role(argv)
            if name == "zygote":
                name = _core_role(pid)
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    tid = int(task.name)
                    comm = (task / "comm").read_text().strip()
                    out[(pid, tid)] = (name, comm, cpu_seconds(pid, tid))
    return out


def _core_role(pid: int) -> str:
    """An engine core forked from the core zygote keeps the zygote's command line, which
    names no role: "core" (under the default load the decode core is the one with the
    most engine-thread CPU; a prefill core's is the prompts' GEMMs)."""
    with contextlib.suppress(OSError):
        if any(t.name != str(pid) for t in Path(f"/proc/{pid}/task").iterdir()):
            return "core"
    return "zygote"


def diff(before: dict[Any, Any], after: dict[Any, Any], tokens: int) -> list[dict[str, Any]]:
    procs: dict[int, dict[str, Any]] = {}
    for (pid, tid), (name, comm, cpu) in after.items():
        spent = cpu - before.get((pid, tid), (name, comm, 0.0))[2]
        entry = procs.setdefault(pid, {"pid": pid, "role": name, "cpu_s": 0.0, "threads": {}})
        entry["cpu_s"] += spent
        entry["threads"][comm] = entry["threads"].get(comm, 0.0) + spent
    rows = []
    for entry in sorted(procs.values(), key=lambda e: -e["cpu_s"]):
        total = entry["cpu_s"]
        if total < 0.01:
            continue
        rows.append(
            {
                "pid": entry["pid"],
                "role": entry["role"],
                "cpu_s": round(total, 3),
                "cpu_ms_per_token": round(total / tokens * 1e3, 4),
                "threads": {
                    k: round(v, 3)
                    for k, v in sorted(entry["threads"].items(), key=lambda kv: -kv[1])
                    if v >= 0.02 * total
                },
            }
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="a model dir, or 'default' (SmolLM2)")
    p.add_argument("--model-name", dest="preset", default="tiny", choices=serve_models.NAMES)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--setups", default="default", choices=list(serve.SETUPS))
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--port", type=int, default=8760)
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--repeats", type=int, default=1, help="points measured one after another")
    args = p.parse_args()
    model = serve.model_dir(args)
    load = Load(args.num_prompts, args.input_len, args.output_len)
    proc, url, _ = serve.start_ours(args.setups, model, args)
    points = []
    try:
        name = asyncio.run(served_model(url))
        asyncio.run(warm_up(url, name, load))
        for _ in range(args.repeats):
            before = snapshot(proc.pid)
            client_before = resource.getrusage(resource.RUSAGE_SELF)
            load_before = os.getloadavg()[0]
            point = asyncio.run(run_point(url, name, load, args.concurrency))
            client_after = resource.getrusage(resource.RUSAGE_SELF)
            after = snapshot(proc.pid)
            tokens = args.num_prompts * args.output_len
            rows = diff(before, after, tokens)
            client = (client_after.ru_utime + client_after.ru_stime) - (
                client_before.ru_utime + client_before.ru_stime
            )
            total = sum(r["cpu_s"] for r in rows)
            points.append(
                {
                    "point": point,
                    "load_avg_before": round(load_before, 2),
                    "load_avg_after": round(os.getloadavg()[0], 2),
                    "server_cpu_s": round(total, 3),
                    "server_cpu_ms_per_token": round(total / tokens * 1e3, 4),
                    "client_cpu_s": round(client, 3),
                    "per_process": rows,
                }
            )
            print(json.dumps(points[-1]), file=sys.stderr)
            time.sleep(0.5)
    finally:
        serve.stop(proc)
    out = {
        "model": Path(model).name,
        "dtype": args.dtype,
        "setup": args.setups,
        "load": vars(load),
        "points": points,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
