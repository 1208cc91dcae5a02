"""The tier markers select what they say (tests/tiers.py): ``-m unit`` (make test-fast)
keeps the in-process tests of a directory and drops the ones that start a cluster."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.testing.loopback import ROOT
from tests.tiers import TIERS

pytestmark = pytest.mark.unit

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


def _declared_tiers(path: Path) -> list[str]:
    """The tier markers of the module's ``pytestmark`` (one mark or a list)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            marks = node.value.elts if isinstance(node.value, ast.List) else [node.value]
            names = [ast.unparse(m).removeprefix("pytest.mark.").split("(")[0] for m in marks]
            return [n for n in names if n in TIERS]
    return []


def test_every_test_file_declares_its_tier() -> None:
    """Each file says its tier (issue 45): ``pytestmark = pytest.mark.TIER``, with a test of
    another tier marked itself; the k8s and k8s_real directories are their tier."""
    undeclared, several = [], []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if {"k8s", "k8s_real"} & set(path.relative_to(ROOT).parts):
            continue
        tiers = _declared_tiers(path)
        if not tiers:
            undeclared.append(str(path.relative_to(ROOT)))
        elif len(tiers) > 1:
            several.append(str(path.relative_to(ROOT)))
    assert undeclared == [] and several == [], (undeclared, several)
