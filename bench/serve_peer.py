"""`pdserve up` against vLLM's CPU build on the default model, per dtype; and what
bench/serve.py records about each side (model path, dtype and thread settings).

Run as a script, it runs bench/serve.py's peer mode once per ``--dtypes`` entry: for
each, the configuration (``--setups``, named before the run), then the peer: vLLM started
here from ``--vllm-python`` on the same model directory and dtype (vLLM's own thread
defaults: one OpenMP thread, a core kept free), or an already running server at
``--peer-url`` (one dtype then); three interleaved repetitions at concurrency 16, the peer
first and second in turn. Last stdout line: JSON with ``peer_ratio_default_model`` (per
dtype: median and range of ours / peer output tok/s) and each dtype's bench/serve.py JSON.
Other arguments go to bench/serve.py as they are.

    python bench/serve_peer.py --model default --vllm-python ~/vllm-venv/bin/python
    python bench/serve_peer.py --model default --setups colocated --vllm-python ...
    python bench/serve_peer.py --preset tiny --dtypes float32 bfloat16
    python bench/serve_peer.py --quick --model DIR --dtypes float32 --peer-url URL

The rest of this module is what bench/serve.py records about each side.

The peer's model path comes from its ``/v1/models`` (``root``, else ``id``); its dtype
from the model card where the server states one, else from the serving process's own
command line (``--dtype``; ``auto`` resolved from the model's config.json), found by the
port it listens on when it runs on this machine. Thread settings of a side are, per
process of it (the server and its children, e.g. vLLM's engine core, our workers): the
OS threads, the CPU affinity, the thread-related environment and any ``--cpu-threads``.
Nothing here is trusted blindly: a field that cannot be read is recorded as ``None``
with where it was looked for.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

from pdserve.engine.config import DTYPES
from pdserve.local.proc_group import end_group

THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "KMP_BLOCKTIME",
    "OMP_WAIT_POLICY",
    "PDSERVE_ENFORCE_EAGER",
    "PDSERVE_CPU_LINEAR",
)


async def model_card(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
        data = await resp.json()
    return dict(data["data"][0])


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _config_dtype(model_path: str) -> str | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    got = config.get("torch_dtype") or config.get("dtype")
    return str(got) if got else None


def listening_pid(port: int) -> int | None:
    """The pid of this user's process listening on TCP ``port`` (loopback or any)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()  # state, ppid, pgrp, session, ...


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for p in _pids():
        try:
            parents[p] = int(_stat(p)[1])
        except (OSError, ValueError, IndexError):
            continue
    out, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def process_threads(pid: int) -> dict[str, Any] | None:
    """One process's thread settings (None if it is gone or not ours to read)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    env = dict(e.split("=", 1) for e in environ if "=" in e)
    threads = next((int(s.split()[1]) for s in status if s.startswith("Threads:")), None)
    try:
        affinity = sorted(os.sched_getaffinity(pid))
    except OSError:
        affinity = []
    return {
        "pid": pid,
        "argv": [a for a in argv if a][:40],
        "os_threads": threads,
        "affinity": affinity,
        "cpu_threads_arg": _flag(argv, "--cpu-threads"),
        "env": {k: env[k] for k in THREAD_ENV if k in env},
    }


def side_threads(root_pid: int | None) -> list[dict[str, Any]]:
    """Thread settings of a server and every process under it."""
    if root_pid is None:
        return []
    return [t for p in descendants(root_pid) if (t := process_threads(p)) is not None]


async def describe_peer(url: str) -> dict[str, Any]:
    """The peer's model path, dtype (and where it was read) and thread settings."""
    card = await model_card(url)
    path = str(card.get("root") or card.get("id"))
    parsed = urlparse(url)
    local = parsed.hostname in ("127.0.0.1", "localhost", "::1")
    pid = listening_pid(parsed.port or 80) if local else None
    procs = side_threads(pid)
    if not Path(path).is_dir() and procs:  # a served name: the path it was started with
        path = _flag(procs[0]["argv"], "--model") or path
    dtype, source = card.get("dtype"), "/v1/models"
    if dtype is None and procs:
        dtype, source = _flag(procs[0]["argv"], "--dtype") or "auto", "its command line"
    if dtype == "auto":
        dtype, source = _config_dtype(path), "auto: the model's config.json"
    return {
        "url": url,
        "model_path": path,
        "model_card": card,
        "dtype": dtype,
        "dtype_from": source if dtype else "unknown (not in /v1/models, not local)",
        "pid": pid,
        "processes": procs,
    }


def ours_threads(session_pid: int) -> dict[str, Any]:
    """Our side: the ``pdserve up`` process and its workers and routers."""
    procs = side_threads(session_pid)
    workers = [p for p in procs if "--cpu-threads" in p["argv"] or p["cpu_threads_arg"]]
    return {"cpu_threads_per_worker": [p["cpu_threads_arg"] for p in workers], "processes": procs}


def start_vllm(
    python: str, model: str, dtype: str, port: int, wait_s: float = 600.0
) -> subprocess.Popen[str]:
    """vLLM's OpenAI server (docs/benchmarks.md, "serve"), run outside the repository (its
    operator/ would shadow the stdlib's), until its /v1/models answers (``wait_s``: on a
    loaded 2-core host its start-up alone took 27 minutes, docs/performance.md)."""
    import httpx

    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--dtype", dtype, "--no-enable-prefix-caching", "--port", str(port)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(Path("/tmp") / f"serve_peer_vllm_{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        argv, cwd="/tmp", stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    end_group(proc, signal.SIGINT, grace_s=30)
    raise RuntimeError(f"vLLM did not come up on {model} ({dtype}): see {log.name}")


def run_dtype(args: argparse.Namespace, rest: list[str], dtype: str) -> dict[str, Any]:
    bench = Path(__file__).resolve().parent / "serve.py"
    argv = [sys.executable, str(bench), "--model", args.model, "--dtype", dtype]
    argv += ["--setups", args.setups, "--peer-name", args.peer_name, *rest]
    if args.quick:
        argv.append("--quick")
    else:
        argv += ["--concurrency", "16"]
    print(
        f"serve_peer: {dtype}: configuration {args.setups} (named before the run)", file=sys.stderr
    )
    peer = None
    url = args.peer_url
    if not url:
        from serve_models import DEFAULT, default_model_dir

        model = default_model_dir(dtype) if args.model == DEFAULT else args.model
        peer = start_vllm(args.vllm_python, model, dtype, args.peer_port, args.peer_start_s)
        url = f"http://127.0.0.1:{args.peer_port}"
    try:
        done = subprocess.run([*argv, "--peer-url", url], stdout=subprocess.PIPE, text=True)
    finally:
        if peer is not None:  # its engine core and workers too
            end_group(peer, signal.SIGINT, grace_s=60)
    if done.returncode != 0:
        raise RuntimeError(f"bench/serve.py failed for {dtype} (exit {done.returncode})")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2) or a model dir")
    p.add_argument(
        "--preset",
        default="",
        help="a bench model by name instead of --model (bench/serve_models.py: tiny, small, "
        "wide-vocab, deep-narrow); written on first use, served in each --dtypes",
    )
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    p.add_argument("--setups", default="default", help="our one configuration (serve.py's)")
    p.add_argument("--vllm-python", default=str(Path.home() / "vllm-venv" / "bin" / "python"))
    p.add_argument("--peer-url", default="", help="a running peer instead (one dtype)")
    p.add_argument("--peer-port", type=int, default=8399)
    p.add_argument(
        "--peer-start-s",
        type=float,
        default=600.0,
        help="how long vLLM may take to come up (seconds; a loaded host needs more)",
    )
    p.add_argument("--peer-name", default="vllm-cpu")
    p.add_argument("--quick", action="store_true", help="serve.py --quick (the tests')")
    args, rest = p.parse_known_args()
    if args.peer_url and len(args.dtypes) != 1:
        p.error("--peer-url serves one dtype: give one --dtypes")
    if args.preset:
        from serve_models import NAMES, model_dir

        if args.preset not in NAMES:
            p.error(f"--preset {args.preset!r}: expected one of {', '.join(NAMES)}")
        if args.model != "default":
            p.error("--preset and --model name the model twice: give one")
        args.model = str(model_dir(args.preset))  # float32 weights; each dtype loads them
    runs = {dtype: run_dtype(args, rest, dtype) for dtype in args.dtypes}
    ratios = {
        d: {"median": r["peer_ratio"], "range": r["peer_ratio_range"]} for d, r in runs.items()
    }
    key = "peer_ratio_default_model" if args.model == "default" else "peer_ratio_by_dtype"
    out = {"model": args.model, "preset": args.preset or None, "config": args.setups}
    out.update({key: ratios, "runs": runs})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
