"""The anchor of bench/up_startup.py: vLLM's CPU build, time to its first answer on the
same model directory, cold and warm.

vLLM runs from its own venv (``--peer-python``, e.g. ``~/vllm-venv/bin/python``; never a
project dependency; docs/benchmarks.md says how it is installed) through its module entry
point, outside the repository (its ``operator/`` would shadow the stdlib's). Cold: a fresh
home directory (``HOME``, ``VLLM_CACHE_ROOT``, ``XDG_CACHE_HOME`` under it), so its
compile caches start empty. Warm: a second start on the same home. Each start is timed from
launch to the first greedy chat answer (HTTP 200 with text), as pdserve's are.

    python bench/up_startup.py --peer-python ~/vllm-venv/bin/python [--peer-model DIR]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.local.proc_group import end_group

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PEER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


def default_model_dir() -> Path | None:
    """The converted default model in this user's cache (``pdserve up`` writes it)."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "gguf"
    found = sorted(root.glob("*-float32/SmolLM2-135M-Instruct"))
    return found[0] if found else None


def ask(client: httpx.Client, url: str, model: str) -> str | None:
    """The chat answer to QUESTION at ``url`` (16 greedy tokens), or None until it serves."""
    body = {"model": model, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    try:
        r = client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    except httpx.HTTPError:
        return None
    return str(r.json()["choices"][0]["message"]["content"]) if r.status_code == 200 else None


def start_once(python: str, model_dir: Path, home: Path, port: int, timeout: float) -> dict:
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--dtype", "float32", "--port", str(port), "--served-model-name", "peer"]
    env = {**os.environ, **PEER_ENV, "HOME": str(home)}
    env.update(VLLM_CACHE_ROOT=str(home / "vllm"), XDG_CACHE_HOME=str(home / ".cache"))
    log = open(home / f"vllm-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=home, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client() as client:
            while (text := ask(client, url, "peer")) is None:
                if proc.poll() is not None or time.monotonic() - started > timeout:
                    log.flush()
                    tail = Path(log.name).read_text()[-3000:]
                    raise RuntimeError(f"vLLM did not answer (rc={proc.poll()}):\n{tail}")
                time.sleep(0.5)
            return {"first_answer_s": round(time.monotonic() - started, 1), "answer": text}
    finally:
        end_group(proc, signal.SIGINT, grace_s=30)
        log.close()


def run(python: str, model_dir: Path, port: int, timeout: float) -> dict[str, object]:
    """``peer_cold_first_answer_s``, ``peer_warm_first_answer_s`` and the answers."""
    home = Path(tempfile.mkdtemp(prefix="vllm-cold-home-"))
    try:
        runs = {way: start_once(python, model_dir, home, port, timeout) for way in ("cold", "warm")}
    finally:
        shutil.rmtree(home, ignore_errors=True)
    out: dict[str, object] = {"peer_model_dir": str(model_dir)}
    for way, got in runs.items():
        out.update({f"peer_{way}_{k}": v for k, v in got.items()})
    return out
