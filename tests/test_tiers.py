"""The tier markers select what they say (tests/tiers.py): ``-m unit`` (make test-fast)
keeps the in-process tests of a directory and drops the ones that start a cluster."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.testing.loopback import ROOT
from tests.tiers import TIERS, mark_tiers

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


class _Item:
    """What mark_tiers reads of a collected test (a stand-in: no second pytest run)."""

    def __init__(self, own: str, fixtures: tuple[str, ...]) -> None:
        self.marks = [pytest.mark.unit.mark] if own == "unit" else []
        self.path = ROOT / "tests" / "router" / "test_made_up.py"
        self.module, self.fixturenames, self.nodeid = None, fixtures, "test_made_up.py::t"

    def iter_markers(self):  # type: ignore[no-untyped-def]
        return iter(self.marks)

    def add_marker(self, name: str) -> None:
        self.marks.append(getattr(pytest.mark, name).mark)


def test_a_unit_test_that_starts_a_cluster_is_refused() -> None:
    with pytest.raises(pytest.UsageError, match=r"test_made_up\.py::t \(uses a cluster"):
        mark_tiers([_Item("unit", ("up",))])  # type: ignore[list-item]
    fine = _Item("unit", ("tmp_path",))
    mark_tiers([fine])  # type: ignore[list-item]
    inferred = _Item("", ("up",))
    mark_tiers([inferred])  # type: ignore[list-item]
    assert [m.name for m in inferred.marks] == ["cluster"]
