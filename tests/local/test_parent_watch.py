"""local/parent_watch.py: a process ``pdserve up`` started ends when ``pdserve up`` is gone,
killed hard included (before, its router and workers went on holding their ports).

Real processes: a parent that starts a child with ``PDSERVE_PARENT_PID`` set, as
``LocalCluster`` does, then dies by SIGKILL. tests/local/test_up_lone_decode.py kills a
whole ``pdserve up`` hard the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pdserve.local.proc_group import poll_until
from tests.workers.worker_helpers import gone

pytestmark = pytest.mark.unit

# The child: watches its parent, records a SIGTERM, and (``ignore``) stays up after it.
CHILD = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    from pdserve.local import parent_watch
    parent_watch.GRACE_S = 0.5
    out, ignore = Path(sys.argv[1]), sys.argv[2] == "ignore"
    def on_term(*_):
        out.write_text("SIGTERM")
        if not ignore:
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    assert parent_watch.watch_from_env() is not None
    out.write_text("watching")
    while True:
        time.sleep(0.05)
""")
# The parent: starts the child with its own pid in the variable, prints the child's pid.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                             env={**os.environ, "PDSERVE_PARENT_PID": str(os.getpid())},
                             start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int, Path]:
    out = tmp_path / "child.txt"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(out), mode], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    poll_until(lambda: out.exists() and out.read_text() == "watching", 30, 0.05)
    return parent, child, out


@pytest.mark.parametrize("mode", ["exit", "ignore"])
def test_a_child_ends_when_its_parent_is_killed_hard(tmp_path: Path, mode: str) -> None:
    parent, child, out = _start(tmp_path, mode)
    try:
        assert not gone(child, timeout=1.0)  # the parent lives: the child stays
        parent.kill()  # SIGKILL: the parent can stop nothing itself
        parent.wait()
        # SIGTERM within a poll (0.5 s); a child that ignores it gets SIGKILL after the grace
        assert gone(child, timeout=10.0)
        assert out.read_text() == "SIGTERM"
    finally:
        parent.kill()
        if not gone(child, timeout=0.1):
            os.kill(child, signal.SIGKILL)


def test_without_the_variable_nothing_is_watched() -> None:
    probe = (
        "import os; os.environ.pop('PDSERVE_PARENT_PID', None); "
        "from pdserve.local import parent_watch; print(parent_watch.watch_from_env())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None", out.stderr
    probe = (
        "import os; os.environ['PDSERVE_PARENT_PID'] = str(os.getppid()); "
        "from pdserve.local import parent_watch; parent_watch.watch_from_env(); "
        "print('PDSERVE_PARENT_PID' in os.environ)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr  # not handed on to its own children
