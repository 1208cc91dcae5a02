"""A worker is two processes: the HTTP front end and its engine core.

Real workers on loopback, the tiny model from disk: where the engine runs, what a client
sees when the core dies under its stream, and that neither process outlives the other;
each for a core that is the worker's own child and for one forked by a core zygote
(worker/core/zygote.py; tests/workers/test_core_zygote.py has the zygote's own faults).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.local.processes import LocalCluster, Proc
from pdserve.protocol.codec import to_dict
from pdserve.protocol.contract import GenerateRequest
from tests.workers.worker_helpers import (
    AUTH,
    children,
    gone,
    parent,
    sampling,
    stats,
    worker_cluster,
)

pytestmark = pytest.mark.cluster

CORE = b"pdserve.worker.core.main"


def _core_of(proc: Proc) -> int:
    """The pid of the worker's engine core, as its /stats names it: without a zygote, its
    child running worker/core/main.py; with one, a child of the zygote and not of the worker."""
    assert proc.popen is not None
    core = int(stats(proc.url)["core_pid"])
    starter = parent(core)
    forked = b"pdserve.worker.core.zygote" in Path(f"/proc/{starter}/cmdline").read_bytes()
    if forked:
        assert core not in children(proc.popen.pid)
    else:
        assert starter == proc.popen.pid, (starter, proc.popen.pid)
        assert CORE in Path(f"/proc/{core}/cmdline").read_bytes()
    return core


@pytest.fixture(scope="module", params=["zygote", "child"])
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """Two workers of each role, started once per way of starting cores (one start, not
    three): the first test reads prefill-0 and decode-0, each later one kills a worker of
    its own (decode-1, then prefill-1), so no test sees another's victim."""
    logs = tmp_path_factory.mktemp("engine-core")
    zygote = request.param == "zygote"
    with worker_cluster(tiny_model_dir, logs, num_prefill=2, num_decode=2, core_zygote=zygote) as c:
        for proc in c.procs:  # the cores started the way this run asked
            core = int(stats(proc.url)["core_pid"])
            forked = b"core.zygote" in Path(f"/proc/{core}/cmdline").read_bytes()
            assert forked == zygote, (request.param, proc.name)
        yield c


def _named(cluster: LocalCluster, name: str) -> Proc:
    return next(p for p in cluster.procs if p.name == name)


def _generate_body(max_tokens: int) -> dict[str, object]:
    return to_dict(
        GenerateRequest(f"core-{time.monotonic_ns()}", [5, 6, 7, 8], sampling(max_tokens))
    )


@pytest.mark.timeout(300)
def test_engine_core_is_its_own_process_named_pdserve_engine(cluster: LocalCluster) -> None:
    for name in ("prefill-0", "decode-0"):
        p = _named(cluster, name)
        assert p.popen is not None
        worker = p.popen.pid
        assert stats(p.url)["pid"] == worker  # the front end answers
        core = _core_of(p)
        names = {(t / "comm").read_text().strip() for t in Path(f"/proc/{core}/task").iterdir()}
        assert "pdserve-engine" in names, names
        worker_names = {
            (t / "comm").read_text().strip() for t in Path(f"/proc/{worker}/task").iterdir()
        }
        assert "pdserve-engine" not in worker_names  # no engine beside the HTTP loop
        # The front end's sockets to its core were bound in a temporary directory that is
        # gone once the core answered: a worker killed hard leaves nothing in /tmp.
        bound = _unix_socket_paths(worker)
        assert bound and all("pdserve-core-" in path for path in bound), bound
        assert not any(Path(path).parent.exists() for path in bound), bound


def _unix_socket_paths(pid: int) -> list[str]:
    """The bound names of ``pid``'s Unix sockets (ZMQ's ipc:// endpoints among them)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:  # a descriptor closed between the listing and the read is not a socket of ours
            target = os.readlink(fd)
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
            paths.append(fields[7])
    return paths


@pytest.mark.timeout(300)
def test_core_death_ends_the_stream_with_a_worker_fault_and_the_worker_exits(
    cluster: LocalCluster,
) -> None:
    """SIGKILL the decode worker's core mid-stream: the open stream ends with an error
    line the router reads as a worker fault (so it migrates the stream), /health turns
    503, and the front end exits (non-zero) for its supervisor to restart it."""
    d = _named(cluster, "decode-1")
    assert d.popen is not None
    core = _core_of(d)
    lines: list[dict[str, object]] = []
    with (
        httpx.Client(timeout=30, auth=AUTH) as http,
        http.stream("POST", d.url + "/generate", json=_generate_body(1000)) as r,
    ):
        assert r.status_code == 200
        for raw in r.iter_lines():
            if not raw:
                continue
            lines.append(json.loads(raw))
            if len(lines) == 3:
                os.kill(core, signal.SIGKILL)
    last = lines[-1]
    assert last.get("error"), last
    assert last["error"]["code"] != "request_failed"  # type: ignore[index]
    assert len(lines) < 1000  # it ended early, with the error
    # Out of rotation at once (the front end exits 2 s later; a slow machine may
    # take the whole grace to get here: then it is already gone).
    with contextlib.suppress(httpx.ConnectError):
        assert httpx.get(d.url + "/health", timeout=5).status_code == 503
    assert d.popen.wait(30) == 1  # the front end followed its core


@pytest.mark.timeout(300)
def test_front_end_death_takes_the_core_with_it(cluster: LocalCluster) -> None:
    """SIGKILL only the front end (not its process group): the kernel kills the core
    too (PR_SET_PDEATHSIG), or the zygote that forked it does, so no orphan holds the
    pool's memory or its ports."""
    p = _named(cluster, "prefill-1")
    assert p.popen is not None
    core = _core_of(p)
    os.kill(p.popen.pid, signal.SIGKILL)
    p.popen.wait(10)
    assert gone(core, 10), "the engine core outlived its front end"
