"""The drain rules of a planned scale-down (local/drain.py), without a model.

Sockets are real: a port nobody listens on (refused), and one that accepts but never
answers (a worker too loaded to reply in time). The end-to-end case, real workers under
load, is tests/local/test_scale_under_load.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from pdserve.local import drain
from pdserve.protocol.contract import WorkerStats
from pdserve.testing.loopback import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A server that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_held_kv_counts_as_busy() -> None:
    """A prefill worker whose handed-off KV is not read yet still owes a decode worker."""
    assert drain.busy(WorkerStats()) == 0
    assert drain.busy(WorkerStats(held=1)) == 1
    assert drain.busy(WorkerStats(running=1, waiting=2, loading=3, held=4)) == 10


def test_a_refused_connection_is_idle_a_late_answer_is_busy(silent_url: str) -> None:
    assert not drain.worker_busy(f"http://127.0.0.1:{free_port()}", None)
    started = time.monotonic()
    assert drain.worker_busy(silent_url, None, timeout_s=0.3)
    assert time.monotonic() - started < 5


def test_an_unanswering_router_still_lists_the_worker(silent_url: str) -> None:
    """Not knowing whether the router routes there is no reason to stop the worker."""
    for router in (f"http://127.0.0.1:{free_port()}", silent_url):  # refused, then late
        assert drain.router_lists(router)("http://127.0.0.1:1")


def test_waits_end_at_the_deadline_or_when_the_process_is_gone() -> None:
    soon = time.monotonic() + 0.6
    assert not drain.wait_unrouted("u", lambda _: True, soon, alive=lambda: True)
    assert time.monotonic() >= soon
    assert drain.wait_unrouted("u", lambda _: True, time.monotonic() + 60, alive=lambda: False)
    assert drain.wait_unrouted("u", lambda _: False, time.monotonic() + 60, alive=lambda: True)
    gone = f"http://127.0.0.1:{free_port()}"  # refused: idle on two polls in a row
    assert drain.wait_idle(gone, None, time.monotonic() + 60, alive=lambda: True)
