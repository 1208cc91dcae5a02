"""The engine-core zygote (worker/core/zygote.py): real zygote processes forking real cores.

A forked core reports its exit and can be killed through its connection; a worker that
dies takes its core with it; a zygote that dies takes its cores (and so their workers)
with it, and ``pdserve up``'s cluster starts a new one for the next worker; a request
whose environment the zygote's imports could not have honoured gets a plain process.
tests/workers/test_engine_core.py runs a worker's own faults both ways.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve import env
from pdserve.local.proc_group import poll_until
from pdserve.protocol.codec import to_dict
from pdserve.protocol.contract import GenerateRequest
from pdserve.worker.core.zygote import (
    ForkedCore,
    ZygoteProcess,
    refusal,
    request_bytes,
    request_core,
    spawn_core,
)
from tests.workers.worker_helpers import (
    AUTH,
    assert_all_free,
    children,
    gone,
    parent,
    sampling,
    stats,
    worker_cluster,
)

pytestmark = pytest.mark.cluster


def test_refusal_names_the_keys_the_imports_read() -> None:
    base = {"HOME": "/root", "OMP_NUM_THREADS": "1"}
    ours = {**base, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}  # added by the imports
    assert refusal(base, ours, dict(base)) == ""  # a new process's imports add it alike
    assert (
        refusal(
            base,
            ours,
            {
                **ours,
                "PDSERVE_SERVICE_SECRET": "s",
                "PYTEST_X": "1",
                "PYTHONUNBUFFERED": "1",
                "COLUMNS": "80",
                "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": "1",
            },
        )
        == ""
    )
    why = refusal(base, ours, {**base, "OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1"})
    assert why.endswith("in HF_HUB_OFFLINE, OMP_NUM_THREADS"), why
    moved = {**base, "TORCHINDUCTOR_CACHE_DIR": "/x"}
    assert "TORCHINDUCTOR_CACHE_DIR" in refusal(base, ours, moved)
    assert "HOME" in refusal(base, ours, {"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZygoteProcess]:
    z = ZygoteProcess(log=subprocess.DEVNULL)
    yield z
    z.stop()
    assert not Path(z.path).exists()


def _core_args(tmp_path: Path) -> list[str]:
    """Addresses nobody binds: the core connects (lazily) and waits for its config."""
    return [f"ipc://{tmp_path}/commands", f"ipc://{tmp_path}/results"]


@pytest.mark.timeout(120)
def test_a_forked_core_reports_its_exit_and_is_killed_through_its_connection(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    core = request_core(zygote.path, _core_args(tmp_path))
    assert parent(core.pid) == zygote.proc.pid
    # a session (so a CFS autogroup) of its own: not one group for every core of a cluster
    poll_until(lambda: os.getsid(core.pid) == core.pid, 10, 0.01, what="the core's session")
    assert os.getsid(zygote.proc.pid) != core.pid
    assert core.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        core.wait(0.2)
    core.kill()
    assert core.wait(15) == -signal.SIGKILL
    assert core.poll() == -signal.SIGKILL and gone(core.pid)
    assert zygote.proc.poll() is None  # the zygote serves on


@pytest.mark.timeout(120)
def test_a_worker_that_dies_takes_its_forked_core_with_it(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    asker = textwrap.dedent(f"""
        import sys, time
        from pdserve.worker.core.zygote import request_core
        core = request_core({zygote.path!r}, {_core_args(tmp_path)!r})
        print(core.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", asker], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        core = int(proc.stdout.readline())
        assert parent(core) == zygote.proc.pid and not gone(core, 0.3)
        proc.kill()  # SIGKILL: no clean-up of its own ran
    finally:
        proc.kill()
        proc.wait()
    assert gone(core), "the forked core outlived the worker that asked for it"


@pytest.mark.timeout(120)
def test_a_worker_gone_before_the_answer_costs_the_zygote_nothing(
    zygote: ZygoteProcess, tmp_path: Path
) -> None:
    """A request whose sender closed at once: the core forked for it is killed (nobody
    owns it) and the zygote serves the next request; a malformed request is dropped."""
    for payload in (request_bytes(_core_args(tmp_path)), b"\x00\x00\x00\x05{bad}"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(zygote.path)
            socket.send_fds(s, [payload], [0, 1, 2])
    core = request_core(zygote.path, _core_args(tmp_path))
    assert zygote.proc.poll() is None and core.poll() is None
    orphans = [p for p in children(zygote.proc.pid) if p != core.pid]
    assert all(gone(p) for p in orphans), orphans
    core.kill()
    assert core.wait(15) == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_zygote_whose_starter_died_ends_and_takes_its_cores(tmp_path: Path) -> None:
    """``pdserve up`` (or a test session) killed hard: its zygote must not linger, nor the
    cores it forked."""
    starter = textwrap.dedent(f"""
        import sys, time
        from pdserve.worker.core.zygote import ZygoteProcess, request_core
        z = ZygoteProcess()
        core = request_core(z.path, {_core_args(tmp_path)!r})
        print(z.proc.pid, core.pid, z.path, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        zygote, core, path = proc.stdout.readline().split()
        assert not gone(int(zygote), 0.3) and not gone(int(core), 0.1)
    finally:
        proc.kill()  # SIGKILL: no clean-up of its own ran
        proc.wait()
    assert gone(int(zygote)), "the zygote outlived the process that started it"
    assert gone(int(core)), "a core outlived its zygote"
    assert not Path(path).exists()


@pytest.mark.timeout(120)
def test_an_environment_the_zygote_cannot_honour_gets_a_plain_process(
    zygote: ZygoteProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.CORE_ZYGOTE, zygote.path)
    forked = spawn_core(_core_args(tmp_path))
    assert isinstance(forked, ForkedCore)
    forked.kill()
    forked.wait(15)
    # torch read the thread count when its OpenMP library loaded in the zygote
    monkeypatch.setenv("OMP_NUM_THREADS", str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 3))
    plain = spawn_core(_core_args(tmp_path))
    try:
        assert isinstance(plain, subprocess.Popen)
        assert parent(plain.pid) == os.getpid()
    finally:
        plain.kill()
        plain.wait()
    monkeypatch.setenv(env.CORE_ZYGOTE, str(tmp_path / "no-such-socket"))  # none there
    with pytest.raises(FileNotFoundError):
        request_core(str(tmp_path / "no-such-socket"), _core_args(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS")
    plain = spawn_core(_core_args(tmp_path))
    assert isinstance(plain, subprocess.Popen)
    plain.kill()
    plain.wait()


@pytest.mark.timeout(300)
def test_a_zygote_that_dies_takes_its_cores_and_the_cluster_starts_another(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster's own zygote (none from the test session): its cores die with it, their
    workers exit (their supervisor restarts them), and the next worker gets a new zygote
    whose core serves."""
    monkeypatch.delenv(env.CORE_ZYGOTE, raising=False)
    with worker_cluster(tiny_model_dir, tmp_path, num_prefill=0, num_decode=1) as cluster:
        assert cluster.zygote is not None
        first, worker = cluster.zygote.proc, cluster.procs[0]
        core = int(stats(worker.url)["core_pid"])
        assert parent(core) == first.pid
        first.kill()
        assert gone(core), "a core outlived its zygote"
        assert worker.popen is not None and worker.popen.wait(30) == 1  # followed its core
        cluster.procs.remove(worker)
        again = cluster.add_worker("decode")
        cluster.wait_healthy(timeout=240)
        assert cluster.zygote.proc.pid != first.pid
        assert parent(int(stats(again.url)["core_pid"])) == cluster.zygote.proc.pid
        body = to_dict(GenerateRequest("after-zygote", [5, 6, 7], sampling(4)))
        r = httpx.post(again.url + "/generate", json=body, auth=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert_all_free(again.url)
    assert cluster.zygote.proc.poll() is not None  # stopped with the cluster
