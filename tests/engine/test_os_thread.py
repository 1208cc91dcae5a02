"""The engine thread's OS name: what /proc, ``top -H`` and bench/stream_overhead.py see."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from pdserve.engine.os_thread import name_os_thread

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_thread_gets_its_python_name_in_proc() -> None:
    seen: dict[str, object] = {}

    def body() -> None:
        seen["ok"] = name_os_thread()
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        seen["comm"] = comm.read_text().strip()

    t = threading.Thread(target=body, name="pdserve-engine-and-more")
    t.start()
    t.join()
    assert seen == {"ok": True, "comm": "pdserve-engine-"}  # the kernel keeps 15 bytes
    main = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    assert main != "pdserve-engine-"  # only the calling thread was renamed
