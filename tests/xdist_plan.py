"""How ``make test`` spreads the suite over two pytest-xdist workers (``-n 2 --dist loadgroup``).

Each test gets an ``xdist_group``, and a group runs whole on one worker:

- the tests on one session-scoped service share it: every test on the shared ``pdserve up``
  (fixture ``shared_up``, through ``up``/``client``) is group ``shared-up``, every test on the
  edge deployment (``deployment``) group ``edge-deployment``, so each starts once per run,
  not once per worker;
- every test of the k8s_real tier is group ``k8s-real``: its control plane starts once;
- a test that names its own group (``pytest.mark.xdist_group(NAME)``) is in it: a module
  whose tests share nothing expensive splits itself over both workers (the compiled family
  matrix: one group a family);
- every other test is grouped with its module, so a module-scoped fixture (a cluster, a
  model, an interpreter child) is set up once.

Under xdist the groups are also ordered longest first (the classic LPT rule: the short unit
modules at the end even out the two workers' finishing times). A group's cost is the sum of
its tests' recorded seconds (setup + call + teardown, from the last run that ran them:
:class:`Durations`, which every run writes) or, for a test no run has recorded yet, a guess
from its tier (``MODULE_SECONDS`` once per module, ``TEST_SECONDS`` per test). A plain
``pytest`` run (no ``-n``) keeps the collection order.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.tiers import tier_of

SHARED_SERVICES = {"shared_up": "shared-up", "deployment": "edge-deployment"}
# The guess for a test no run has recorded: a start per module (a bench script's run, a
# cluster) plus seconds per test.
MODULE_SECONDS = {"unit": 0.0, "k8s": 0.0, "cluster": 10.0, "bench": 20.0, "k8s_real": 30.0}
TEST_SECONDS = {"unit": 0.1, "k8s": 0.3, "cluster": 3.0, "bench": 0.5, "k8s_real": 5.0}
REPO_ROOT = Path(__file__).resolve().parent.parent
# Every run writes its tests' seconds here (git-ignored, this checkout's); a checkout with no
# run yet (a fresh clone) reads the committed snapshot, refreshed by copying the first file.
RECORDED = REPO_ROOT / ".cache" / "test-durations.json"
SNAPSHOT = Path(__file__).with_name("durations.json")


def base_nodeid(nodeid: str) -> str:
    """The node id without the ``@GROUP`` that --dist loadgroup's ids carry (a group names
    a module or a service: a parameter id's own ``@`` is followed by its ``]``)."""
    head, at, tail = nodeid.rpartition("@")
    return head if at and "]" not in tail and "::" not in tail else nodeid


class Durations:
    """Seconds per test (node id -> setup + call + teardown), recorded by every run.

    :meth:`add` sums a test's phases as its reports arrive (in the xdist controller, which
    sees every worker's reports, or in a plain run); :meth:`save` merges them into the
    recorded file, so a run of a few tests updates only theirs."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def add(self, report: pytest.TestReport) -> None:
        key = base_nodeid(report.nodeid)
        self.seen[key] = self.seen.get(key, 0.0) + float(report.duration)

    def save(self, path: Path = RECORDED) -> None:
        if not self.seen:
            return
        merged = {**load_seconds((path,)), **{k: round(v, 2) for k, v in self.seen.items()}}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:  # one test a line: a diff of the snapshot reads well
            out.write("{\n" + ",\n".join(f"{json.dumps(k)}: {merged[k]}" for k in sorted(merged)))
            out.write("\n}\n")
        os.replace(tmp, path)


def load_seconds(paths: tuple[Path, ...] = (RECORDED, SNAPSHOT)) -> dict[str, float]:
    """The first readable file's seconds per test ({} if none)."""
    for path in paths:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            return {str(k): float(v) for k, v in data.items()}
    return {}


def group_of(item: pytest.Item) -> str:
    own = next((m.args[0] for m in item.iter_markers("xdist_group") if m.args), None)
    if own is not None:
        return str(own)
    if "k8s_real" in item.path.parts:
        return "k8s-real"
    fixtures = set(getattr(item, "fixturenames", ()))
    for fixture, group in SHARED_SERVICES.items():
        if fixture in fixtures:
            return group
    return item.nodeid.split("::", 1)[0]


def plan(
    items: list[pytest.Item], loadgroup: bool = False, seconds: Mapping[str, float] | None = None
) -> None:
    """Mark each item's group; under xdist, order the groups longest first (in place) by
    ``seconds`` per test (:func:`load_seconds` by default); under ``--dist loadgroup``, name
    each item's group in its node id (see ``_name_group``)."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = group_of(item)
        if not any(m.args for m in item.iter_markers("xdist_group")):  # its own, or ours
            item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
        if loadgroup:
            _name_group(item, group)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run: collection order

    known = load_seconds() if seconds is None else seconds
    costs = {group: group_cost(members, known) for group, members in groups.items()}

    # sorted() is stable and the collection is the same on every worker: one order for all.
    items[:] = [
        item
        for group in sorted(groups, key=costs.__getitem__, reverse=True)
        for item in groups[group]
    ]


def group_cost(items: list[pytest.Item], seconds: Mapping[str, float]) -> float:
    """A group's seconds: its tests' recorded ones; a tier's guess for the tests without
    (a module's start once for each module that has any)."""
    total = 0.0
    modules: dict[tuple[str, str], None] = {}
    for item in items:
        known = seconds.get(base_nodeid(item.nodeid))
        if known is not None:
            total += known
            continue
        tier = tier_of(item)
        total += TEST_SECONDS[tier]
        modules[(item.nodeid.split("::", 1)[0], tier)] = None
    return total + sum(MODULE_SECONDS[tier] for _, tier in modules)


def _name_group(item: pytest.Item, group: str) -> None:
    """``NODEID@GROUP``, the id from which --dist loadgroup's scheduler reads the group.

    pytest-xdist (3.8) appends it by setting ``item._nodeid``, which pytest 9 no longer
    reads (the id is ``item._id``, a NodeId): the marker was ignored and every test was its
    own unit, so each worker started the shared services and a module's cluster (two
    ``pdserve up`` of the resilience module killing workers at once). Here the id is set
    where this pytest keeps it; on a pytest that still reads ``_nodeid``, xdist does it."""
    if hasattr(item, "_id") and not item.nodeid.endswith("@" + group):
        from _pytest.nodeid import coerce_node_id  # pytest >= 9

        item._id = coerce_node_id(f"{item.nodeid}@{group}")
