"""tests/reaper.py: what a pytest process started is stopped once that process is gone,
even when it dies by SIGKILL (no fixture teardown runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pdserve.local.proc_group import poll_until
from pdserve.testing.loopback import ROOT
from tests.reaper import OWNER, owned_by

pytestmark = pytest.mark.unit

# A stand-in for a pytest process: it names itself as owner, starts the reaper as
# tests/conftest.py does and a "service" in a session of its own, prints the service's pid.
FAKE_PYTEST = f"""
import os, subprocess, sys, time
os.environ[{OWNER!r}] = str(os.getpid())
subprocess.Popen([sys.executable, "tests/reaper.py", str(os.getpid())],
                 stdin=subprocess.PIPE, start_new_session=True)
service = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(service.pid, flush=True)
time.sleep(300)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # killed, not yet waited for by init
    except OSError:
        return True


def test_a_killed_pytest_process_leaves_no_service_running() -> None:
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_PYTEST], cwd=ROOT, text=True, stdout=subprocess.PIPE
    )
    assert fake.stdout is not None
    service = int(fake.stdout.readline())
    assert not _gone(service) and owned_by(fake.pid) != []
    os.kill(fake.pid, signal.SIGKILL)
    fake.wait()
    # The reaper sees EOF at once and scans /proc: well under a second; 30 s for a loaded host.
    poll_until(lambda: _gone(service), 30, what=f"service {service} killed")
    assert owned_by(fake.pid) == []
