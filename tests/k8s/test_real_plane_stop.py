"""The k8s_real control plane's stop at the end of a run (``ControlPlane.stop(kill=True)``,
tests/k8s_real/conftest.py) kills its components at once, where a plain stop gives each
up to 20 s to terminate gracefully. Stand-ins that ignore SIGTERM, as a draining API
server would keep running."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from pdserve.testing.k8s_real.control_plane import ControlPlane

STUBBORN = 'trap "" TERM; sleep 60 & wait'


def test_a_killed_plane_stops_at_once_even_when_its_components_ignore_sigterm(
    tmp_path: Path,
) -> None:
    plane = ControlPlane(tmp_path, tmp_path)
    procs = {
        name: subprocess.Popen(["bash", "-c", STUBBORN], start_new_session=True)
        for name in ("etcd", "kube-apiserver", "kube-controller-manager")
    }
    plane.procs.update(procs)
    started = time.monotonic()
    plane.stop(kill=True)
    assert time.monotonic() - started < 5  # a SIGTERM and its 20 s grace: 60 s for three
    assert plane.procs == {}
    assert [p.returncode for p in procs.values()] == [-9, -9, -9]
