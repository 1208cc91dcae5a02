"""The supervisor restarts dead processes in place with kubelet-style back-off.

Stand-in processes (Python one-liners that exit at once, or sleep) replace the
workers: this is about process lifecycle; the same with real workers under
``pdserve up`` and ``kill -9`` is in test_up_resilience.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pdserve.local.processes import ClusterSpec, LocalCluster, Proc
from pdserve.local.supervise import Supervisor

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

CRASH = [sys.executable, "-c", "print('crashing', flush=True); raise SystemExit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _wait_dead(proc: Proc) -> None:
    assert proc.popen is not None
    proc.popen.wait(20)


def test_backoff_doubles_and_is_capped() -> None:
    sup = Supervisor(LocalCluster.__new__(LocalCluster), base_s=1, max_s=30)
    assert [sup.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_crashing_process_restarts_in_place_after_backoff(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(model_dir=str(tmp_path), log_dir=str(tmp_path)))
    crash = Proc("decode-0", "decode", "http://127.0.0.1:1", CRASH, tmp_path / "d.log")
    steady = Proc("decode-1", "decode", "http://127.0.0.1:2", SLEEP, tmp_path / "s.log")
    cluster._spawn(crash)
    cluster._spawn(steady)
    clock, said = Clock(), []
    sup = Supervisor(cluster, base_s=1, max_s=4, reset_after_s=60, say=said.append, clock=clock)
    try:
        delays = []
        for _ in range(4):
            _wait_dead(crash)
            first_pid = crash.popen.pid  # type: ignore[union-attr]
            assert sup.tick() == []  # noticed: the back-off starts
            delays.append(float(said[-1].split("restarting in ")[1].split("s;")[0]))
            clock.t += delays[-1] - 0.01
            assert sup.tick() == []  # not yet
            clock.t += 0.02
            assert sup.tick() == [crash]
            assert crash.popen.pid != first_pid and crash.url == "http://127.0.0.1:1"  # type: ignore[union-attr]
        assert delays == [1, 2, 4, 4]
        assert sup.restarts == {"decode-0": 4} and cluster.procs == [crash, steady]
        assert steady.popen.poll() is None  # type: ignore[union-attr]
        _wait_dead(crash)
        assert crash.log_path.read_text().count("crashing") == 5  # the log is kept
        clock.t += 120  # a long run since the last restart: the back-off starts over
        sup.tick()
        assert "restarting in 1s" in said[-1]
    finally:
        cluster.stop(grace_s=5)


def test_removed_worker_is_not_restarted(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(model_dir=str(tmp_path), log_dir=str(tmp_path)))
    proc = Proc("prefill-0", "prefill", "http://127.0.0.1:1", CRASH, tmp_path / "p.log")
    cluster._spawn(proc)
    _wait_dead(proc)
    cluster.procs.remove(proc)  # what remove_worker does first (scale-down)
    sup = Supervisor(cluster, base_s=0, say=lambda _: None)
    time.sleep(0.05)
    assert sup.tick() == [] and sup.tick() == []
    cluster.stop(grace_s=5)
