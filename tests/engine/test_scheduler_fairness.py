"""Fair admission across tenants in the engine's waiting queue (issue 24 item 1).

The router admits fairly across API keys, but a worker's waiting queue is shared by every
router replica and every key: without fairness, one key's burst that reached the worker
first fills the batch while another key's single request waits behind all of it."""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free
from test_scheduler import Harness

from pdserve.engine.request import tenant_of

pytestmark = pytest.mark.unit


def _admitted(h: Harness) -> list[str]:
    running = {r.request_id for r in h.sched.running}
    return sorted(running)


def test_a_burst_of_one_tenant_does_not_hold_back_another() -> None:
    """Two places in the batch: A's six requests arrived first, then B's one. B gets the
    second place (before the fix it got the first free place after all of A's)."""
    h = Harness.make(num_blocks=64, max_num_seqs=2)
    for i in range(6):
        h.add(f"a{i}", 20, tenant="k:a")
    h.add("b0", 20, tenant="k:b")
    h.step()
    assert _admitted(h) == ["a0", "b0"]
    while h.sched.has_work:
        h.step()
    order = [r.request_id for r in h.finished]
    assert order.index("b0") < order.index("a1"), order
    assert_all_free(h.blocks)


def test_a_burst_longer_than_any_window_does_not_hold_back_another() -> None:
    """Issue 44 item 6: 100 of A's requests arrived first, then B's one. Before, the
    scheduler looked only through the first 64 waiting, so B waited behind all of A's."""
    h = Harness.make(num_blocks=256, max_num_seqs=2)
    for i in range(100):
        h.add(f"a{i:03}", 8, max_tokens=2, tenant="k:a")
    h.add("b0", 8, max_tokens=2, tenant="k:b")
    h.step()
    assert _admitted(h) == ["a000", "b0"]
    assert sum(len(q) for q in h.sched.waiting_by_tenant.values()) == len(h.sched.waiting)
    while h.sched.has_work:
        h.step()
    assert not h.sched.waiting_by_tenant
    assert_all_free(h.blocks)


def test_one_tenant_is_first_come_first_served_and_preempted_go_first() -> None:
    h = Harness.make(num_blocks=64, max_num_seqs=2)
    for i in range(4):
        h.add(f"r{i}", 20)
    h.step()
    assert _admitted(h) == ["r0", "r1"]
    while h.sched.has_work:
        h.step()
    assert [r.request_id for r in h.finished] == ["r0", "r1", "r2", "r3"]
    assert_all_free(h.blocks)


def test_tenant_is_the_routers_key_salt_only() -> None:
    assert tenant_of("k:abc|r:mine") == "k:abc"
    assert tenant_of("k:abc") == "k:abc"
    assert tenant_of("r:k:fake") == "" and tenant_of(None) == "" and tenant_of("") == ""
