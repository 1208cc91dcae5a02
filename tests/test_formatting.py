"""The formatter's settings are pyproject's alone: no file opts a block out of them
(issue 45, move 6). A line the formatter writes badly is rewritten, not fenced off."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", ".venv", "node_modules", "target", "__pycache__", ".mypy_cache"}
MARKERS = ("# fmt: " + "skip", "# fmt: " + "off", "# yapf: " + "disable")


def _python_files() -> list[Path]:
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # the venv and build outputs
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return found


def test_no_file_fences_code_off_from_the_formatter() -> None:
    listed = _python_files()
    assert len(listed) > 100, "the walk found the tree"
    fenced = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in listed
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(marker in line for marker in MARKERS)
    ]
    assert not fenced, f"formatter opt-outs: {fenced}"
