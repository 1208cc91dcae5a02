"""Item 6 of issue 42: two operator replicas with the shipped peering (the chart's KopfPeering
in each watched namespace, the chart's RBAC for it): one acts, the other waits; the active one
is killed (SIGKILL: no record removed) and the other takes over within the peering lifetime
(15 s, operator/handlers.py) and reconciles what came meanwhile, once."""

from __future__ import annotations

import re
import time

from pdserve.testing.k8s_real.cluster import OperatorProcess, RealCluster
from tests.k8s_real.conftest import WATCHED
from tests.k8s_real.test_apply import wait_ready
from tests.k8s_real.test_faults import llmservice, no_duplicates

NS = "llm-a"
PEERING = f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings/pdserve-operator"
RESUMED = "Resuming operations after the pause"


def _priorities(c: RealCluster) -> list[int]:
    """The priorities of the live replicas' records in the chart's KopfPeering of llm-a."""
    return [int(p["priority"]) for p in ((c.get(PEERING) or {}).get("status") or {}).values()]


def _handled(op: OperatorProcess) -> int:
    """How many handler runs ``op`` has logged (kopf: "Handler '...' succeeded.")."""
    return len(re.findall(r"Handler '[^']+' (?:succeeded|failed)", _log(op)))


def _log(op: OperatorProcess) -> str:
    return op.log(tail=10_000_000)


def test_two_replicas_one_acts_and_the_standby_takes_over(
    chart: RealCluster, operator: OperatorProcess
) -> None:
    c = chart
    # the active replica's record first (the shared operator may have started just now): a
    # standby that finds no live peer acts, then pauses when the record appears. Only its
    # record: one an earlier test's killed replica left stays until it expires (15 s) and
    # kopf's live peers clean it up.
    c.wait(lambda: _priorities(c) == [operator.priority], 90, what="the active replica's record")
    standby = OperatorProcess(c, list(WATCHED), name="standby", priority=operator.priority - 50)
    try:
        # kopf starts every replica paused until its first look at the peering object; the
        # standby stays so (it logs "Resuming" only when it may act)
        c.wait(lambda: standby.priority in _priorities(c), 60, what="the standby's record")
        assert sorted(_priorities(c))[-2:] == [standby.priority, operator.priority]
        c.kubectl("apply", "-f", "-", stdin=llmservice("peer-one"))
        wait_ready(c, NS, "peer-one")
        assert _handled(operator) > 0
        assert _handled(standby) == 0, standby.log()  # paused: not one handler ran
        assert RESUMED not in _log(standby), standby.log()
        operator.kill()  # its node died: its peering record stays until it expires
        killed = time.monotonic()
        c.kubectl("apply", "-f", "-", stdin=llmservice("peer-two"))
        wait_ready(c, NS, "peer-two", timeout=90)
        took = time.monotonic() - killed
        assert _handled(standby) > 0, standby.log()  # only it runs now
        assert RESUMED in _log(standby), standby.log()
        no_duplicates(c, "peer-one")
        no_duplicates(c, "peer-two")
        assert took < 60, f"the standby took {took:.0f}s to take over"
    finally:
        # the shared operator comes back with a higher priority and acts at once; the standby
        # stops cleanly (its peering record goes with it)
        operator.restart()
        standby.stop()
    for name in ("peer-one", "peer-two"):
        c.kubectl("delete", "llmservice", name, "-n", NS, "--wait=true")
