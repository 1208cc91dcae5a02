"""The tier markers select what they say (tests/tiers.py): ``-m unit`` (make test-fast)
keeps the in-process tests of a directory and drops the ones that start a cluster."""

from __future__ import annotations

import subprocess
import sys

from pdserve.testing.loopback import ROOT

UNIT = "tests/router/test_routing.py"  # table-driven, no server
CLUSTER = "tests/router/test_tool_calling.py"  # on the shared `pdserve up` (`up`)


def test_unit_keeps_the_in_process_file_and_drops_the_cluster_one() -> None:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(
        [*cmd, "-m", "unit", UNIT, CLUSTER], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    files = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert files == {UNIT}
    assert "deselected" in out.stdout  # the cluster file's tests were there, and left out
