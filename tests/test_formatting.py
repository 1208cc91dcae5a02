"""The formatter's settings are pyproject's alone: no file opts a block out of them
(issue 45, move 6). A line the formatter writes badly is rewritten, not fenced off."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
MARKERS = ("# fmt: " + "skip", "# fmt: " + "off", "# yapf: " + "disable")


def test_no_file_fences_code_off_from_the_formatter() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(listed) > 100, "git ls-files found the tree"
    fenced = [
        f"{path}:{n}"
        for path in listed
        if (ROOT / path).is_file()
        for n, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1)
        if any(marker in line for marker in MARKERS)
    ]
    assert not fenced, f"formatter opt-outs: {fenced}"
