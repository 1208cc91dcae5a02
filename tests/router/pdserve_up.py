"""``pdserve up`` (1 prefill + 1 decode, float32) on loopback for the conformance tests.

One cluster for the whole session, started by the first module that asks for it: the
fixtures ``up`` (the cluster; every KV block must be free again after each module) and
``client`` (an OpenAI client on it), which tests/router/conftest.py offers every router
test module; :func:`run_up` for a module that needs other flags. The modules on it only
read from the service (no kills, no flags of their own) and measure counters as deltas, so
sharing it saves one ``pdserve up`` start per module.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from pdserve.local.proc_group import end_group
from pdserve.testing.loopback import ROOT, all_kv_free, free_port, wait_until_up, worker_port_base

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
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-transport",
        os.environ.get("PDSERVE_TEST_TRANSPORT", "nixl"),
        "--disagg-threshold",
        str(DISAGG_THRESHOLD),
        "--log-dir",
        str(log_dir),
        # Away from the default 8100/8200 that other loopback tests start from.
        "--worker-port-base",
        str(worker_port_base()),
        "--worker-arg=--max-model-len",
        "--worker-arg=1024",
        *extra,
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        url, workers = wait_until_up(proc)
        yield Up(url, workers, proc)
    finally:
        end_group(proc, signal.SIGINT)


# Started once per run by its first user (~50 s on a loaded machine: the slowest "setup" in
# --durations, charged to whichever test comes first); make test keeps all its users on one
# xdist worker (tests/xdist_plan.py: group shared-up), so it never starts twice.
@pytest.fixture(scope="session")
def shared_up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with run_up(tiny_model_dir, tmp_path_factory.mktemp("up-logs")) as cluster:
        assert len(cluster.workers) == 2, cluster.workers  # one prefill, one decode
        yield cluster


@pytest.fixture(scope="module")
def up(shared_up: Up) -> Iterator[Up]:
    assert shared_up.proc.poll() is None, "the shared pdserve up has exited"
    yield shared_up
    all_kv_free(shared_up.workers)  # after the module's last test, too


@pytest.fixture(scope="module")
def client(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0, timeout=300)
