"""``pdserve up`` (1 prefill + 1 decode, float32) on loopback for the conformance tests.

One cluster per test module: start it in a module-scoped fixture with :func:`run_up`.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.loopback import ROOT, free_port, wait_until_up

# Prompts at least this long (in tokens) are prefilled on the prefill worker: the tests'
# prompts are longer, so every request crosses the P/D hand-off.
DISAGG_THRESHOLD = 8


@dataclass
class Up:
    url: str  # router base URL (no /v1)
    workers: list[str]  # worker base URLs
    proc: subprocess.Popen[str]


@contextlib.contextmanager
def run_up(model_dir: Path, log_dir: Path, *extra: str) -> Iterator[Up]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve", "up", "--model", str(model_dir),
            "--port", str(port), "--dtype", "float32",
            "--kv-transport", os.environ.get("PDSERVE_TEST_TRANSPORT", "nixl"),
            "--disagg-threshold", str(DISAGG_THRESHOLD), "--log-dir", str(log_dir),
            # Away from the default 8100/8200 that other loopback tests start from.
            "--worker-port-base", str(random.randrange(20000, 40000, 200)),
            "--worker-arg=--max-model-len", "--worker-arg=1024", *extra]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        url, workers = wait_until_up(proc)
        yield Up(url, workers, proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
