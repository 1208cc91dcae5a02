"""Session services stop after their last test (tests/early_release.py), once the module
of that test is done, never before a test that uses them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.early_release import Releaser

pytestmark = pytest.mark.unit


class FakeItem:
    def __init__(self, nodeid: str, *fixtures: str) -> None:
        self.nodeid = nodeid
        self.path = Path(nodeid.split("::")[0])
        self.fixturenames = list(fixtures)


def test_a_service_stops_after_its_last_users_module_and_the_latest_first() -> None:
    run = [
        FakeItem("tests/a.py::t1", "svc", "tmp_path"),
        FakeItem("tests/b.py::t2", "svc", "svc_on_top"),
        FakeItem("tests/b.py::t3", "svc"),  # the last user of svc
        FakeItem("tests/b.py::t4", "tmp_path"),  # b's module fixtures tear down after this
        FakeItem("tests/c.py::t5", "other"),
    ]
    stopped: list[str] = []
    releaser = Releaser()  # not the session's own (tests/conftest.py)
    releaser.plan(run)  # type: ignore[arg-type]
    with (
        releaser.released_after_last_user("svc") as svc,
        releaser.released_after_last_user("svc_on_top") as on_top,
    ):
        svc.callback(stopped.append, "svc")
        on_top.callback(stopped.append, "svc_on_top")
        seen = []
        for item, nextitem in zip(run, [*run[1:], None], strict=True):
            releaser.after_teardown(item, nextitem)  # type: ignore[arg-type]
            seen.append(list(stopped))
        # svc_on_top's last test is t2, svc's t3: both stop once module b is done (after
        # t4), the one started on top first; nothing stops before its last test
        assert seen == [[], [], [], ["svc_on_top", "svc"], ["svc_on_top", "svc"]]
    assert stopped == ["svc_on_top", "svc"]  # the fixtures' own exits stop nothing twice


def test_a_service_whose_last_test_ends_the_run_stops_at_once() -> None:
    run = [FakeItem("tests/a.py::t1", "svc")]
    stopped: list[str] = []
    releaser = Releaser()
    releaser.plan(run)  # type: ignore[arg-type]
    with releaser.released_after_last_user("svc") as svc:
        svc.callback(stopped.append, "svc")
        releaser.after_teardown(run[0], None)  # type: ignore[arg-type]
        assert stopped == ["svc"]
