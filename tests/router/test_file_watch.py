"""router/file_watch.py: a file is read again only when its stamp moves, and a failed read
is tried again on the next check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.router.file_watch import WatchedFile

pytestmark = pytest.mark.unit


def _numbers(path: str) -> list[int]:
    return [int(w) for w in Path(path).read_text().split()]  # ValueError on a bad word


def test_read_once_then_only_on_a_change(tmp_path: Path) -> None:
    f = tmp_path / "n.txt"
    f.write_text("1 2")
    reads: list[str] = []
    watch = WatchedFile(f, lambda p: reads.append(p) or _numbers(p))
    assert watch.changed() == [1, 2]
    assert watch.changed() is None and watch.changed() is None
    assert len(reads) == 1
    mtime = f.stat().st_mtime_ns
    f.write_text("1 2 3")
    os.utime(f, ns=(mtime, mtime))  # the same mtime: the size still tells the change
    assert watch.changed() == [1, 2, 3]
    assert len(reads) == 2


def test_a_failed_read_keeps_the_old_stamp(tmp_path: Path) -> None:
    f = tmp_path / "n.txt"
    f.write_text("7")
    watch = WatchedFile(f, _numbers)
    assert watch.changed() == [7]
    good = watch.stamp
    f.write_text("7 x")  # caught half written
    with pytest.raises(ValueError):
        watch.changed()
    assert watch.stamp == good
    with pytest.raises(ValueError):
        watch.changed()  # tried again, not taken as seen
    f.write_text("7 8")
    assert watch.changed() == [7, 8]
    f.unlink()
    with pytest.raises(OSError):
        watch.changed()
