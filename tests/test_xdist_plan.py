"""make test's grouping and order for two xdist workers (tests/xdist_plan.py): a shared
service's tests form one group, every other test goes with its module, and under xdist the
longest groups come first, each group's tests in their collection order."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.testing.loopback import ROOT
from tests.xdist_plan import Durations, base_nodeid, group_cost, group_of, load_seconds, plan

pytestmark = pytest.mark.unit


class FakeItem:
    """What group_of, plan and tiers.tier_of read of a pytest item."""

    def __init__(self, nodeid: str, *fixtures: str) -> None:
        self.nodeid = nodeid
        self.path = Path(nodeid.split("::")[0])
        self.fixturenames = ["tiny_model_dir", *fixtures]
        self.marks: list[pytest.Mark] = []

    def iter_markers(self, name: str | None = None) -> Iterator[pytest.Mark]:
        return (m for m in self.marks if name is None or m.name == name)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.marks.append(marker.mark)


def items() -> list[FakeItem]:
    return [
        FakeItem("tests/router/test_routing.py::test_a"),
        FakeItem("tests/router/test_echo.py::test_b", "up", "shared_up"),
        FakeItem("tests/router/test_routing.py::test_c"),
        FakeItem("tests/local/test_scale_under_load.py::test_d"),
        FakeItem("tests/edge/test_fuzz.py::test_e", "deployment"),
        FakeItem("tests/router/test_tool_calling.py::test_f", "client", "up", "shared_up"),
        _own_group(FakeItem("tests/engine/test_family_compiled.py::test_g[llama]"), "g-llama"),
    ]


def _own_group(item: FakeItem, group: str) -> FakeItem:
    item.add_marker(pytest.mark.xdist_group(group))
    return item


def test_shared_services_are_one_group_and_the_rest_go_with_their_module() -> None:
    groups = [group_of(item) for item in items()]  # type: ignore[arg-type]
    assert groups == [
        "tests/router/test_routing.py",
        "shared-up",
        "tests/router/test_routing.py",
        "tests/local/test_scale_under_load.py",
        "edge-deployment",
        "shared-up",
        "g-llama",  # a test that names its group keeps it, whatever its module
    ]


# Recorded seconds of a run (what tests/xdist_plan.py reads): the edge deployment's and
# test_a's are not recorded, so they are guessed from their tiers (cluster: 10 s a module
# + 3 s a test; unit: 0.1 s).
SECONDS = {
    "tests/router/test_echo.py::test_b": 100.0,
    "tests/router/test_tool_calling.py::test_f": 20.0,
    "tests/local/test_scale_under_load.py::test_d": 80.0,
    "tests/router/test_routing.py::test_c": 0.5,
}


def test_under_xdist_the_longest_groups_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    got = items()
    plan(got, seconds=SECONDS)  # type: ignore[arg-type]
    costs = {
        g: group_cost([i for i in got if group_of(i) == g], SECONDS)  # type: ignore[misc]
        for g in ("shared-up", "tests/local/test_scale_under_load.py", "edge-deployment")
    }
    assert costs == {
        "shared-up": 120.0,
        "tests/local/test_scale_under_load.py": 80.0,
        "edge-deployment": 13.0,  # guessed: one cluster module, one test
    }
    assert [i.nodeid.split("::")[1] for i in got] == [
        "test_b",
        "test_f",
        "test_d",
        "test_e",
        "test_a",
        "test_c",
        "test_g[llama]",
    ]
    for item in got:
        (mark,) = item.iter_markers("xdist_group")
        assert mark.args == (group_of(item),)  # type: ignore[arg-type]


def test_a_run_records_each_tests_seconds_and_the_plan_reads_them(tmp_path: Path) -> None:
    """The seconds each run records (setup + call + teardown, under the id without its
    ``@GROUP``) are merged into the file: a run of a few tests updates only theirs."""
    path = tmp_path / "durations.json"
    path.write_text('{"tests/a.py::test_old": 3.0, "tests/a.py::test_x": 1.0}')
    durations = Durations()
    for when, seconds in (("setup", 2.0), ("call", 0.5), ("teardown", 0.25)):
        report = pytest.TestReport(
            "tests/a.py::test_x@tests/a.py",
            ("tests/a.py", 1, "test_x"),
            {},
            "passed",
            None,
            when,
            duration=seconds,
        )
        durations.add(report)
    durations.save(path)
    assert load_seconds((tmp_path / "missing.json", path)) == {
        "tests/a.py::test_old": 3.0,
        "tests/a.py::test_x": 2.75,
    }
    assert base_nodeid("tests/a.py::test_p[u@host]") == "tests/a.py::test_p[u@host]"
    assert base_nodeid("tests/a.py::test_p[u@host]@shared-up") == "tests/a.py::test_p[u@host]"


def test_a_plain_run_keeps_the_collection_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    got = items()
    plan(got)  # type: ignore[arg-type]
    assert [i.nodeid for i in got] == [i.nodeid for i in items()]
    assert all(len(list(i.iter_markers("xdist_group"))) == 1 for i in got)


def test_a_port_block_is_reserved_machine_wide() -> None:
    """Two processes given the same candidate order still get different port blocks: the
    first holds its block's lock (pdserve.testing.loopback.worker_port_base)."""
    ordered = "import random; random.shuffle = lambda x: None\n"
    code = (
        ordered + "from pdserve.testing.loopback import worker_port_base; print(worker_port_base())"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code + "; input()"],
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        held = int(holder.stdout.readline())
        other = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            text=True,
            capture_output=True,
            check=True,
            timeout=60,
        )
        assert int(other.stdout) != held
    finally:
        holder.communicate("\n", timeout=60)


# The three plan tests above by name (a -k that matched this test too would recurse).
PLAN_TESTS = "longest_groups_go_first or plain_run_keeps or shared_services_are_one_group"


def test_under_loadgroup_one_module_runs_on_one_worker() -> None:
    """A real two-worker run of this module's three plan tests: one group, one worker.
    (Under pytest 9, xdist's own renaming of the node ids had no effect: the tests were
    spread over both workers, and so were the shared services and module clusters.)"""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-k",
            PLAN_TESTS,
            "tests/test_xdist_plan.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = [line for line in out.stdout.splitlines() if " PASSED " in line]
    assert len(ran) == 3 and all(line.endswith("@tests/test_xdist_plan.py ") for line in ran), ran
    assert len({line.split()[0] for line in ran}) == 1, ran  # [gw0] or [gw1], one of them
