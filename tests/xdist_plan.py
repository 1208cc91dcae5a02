"""How ``make test`` spreads the suite over two pytest-xdist workers (``-n 2 --dist loadgroup``).

Each test gets an ``xdist_group``, and a group runs whole on one worker:

- the tests on one session-scoped service share it: every test on the shared ``pdserve up``
  (fixture ``shared_up``, through ``up``/``client``) is group ``shared-up``, every test on the
  edge deployment (``deployment``) group ``edge-deployment``, so each starts once per run,
  not once per worker;
- every test of the k8s_real tier is group ``k8s-real``: its control plane starts once;
- every other test is grouped with its module, so a module-scoped fixture (a cluster, a
  model, an interpreter child) is set up once.

Under xdist the groups are also ordered longest first (the classic LPT rule: the short unit
modules at the end even out the two workers' finishing times). A group's cost is its
modules' seconds in ``KNOWN_SECONDS`` (measured alone, rounded) or a guess from its tests'
tiers (``MODULE_SECONDS``, ``TEST_SECONDS``). A plain ``pytest`` run (no ``-n``) keeps the
collection order.
"""

from __future__ import annotations

import os

import pytest

from tests.tiers import tier_of

SHARED_SERVICES = {"shared_up": "shared-up", "deployment": "edge-deployment"}
# Seconds, measured alone on the 2-core machine (setup included), for the modules and
# shared services that take longest; everything else is estimated from its tiers.
KNOWN_SECONDS = {
    "k8s-real": 260,  # + test_peering (~50 s), test_scale_subresource (~10 s)
    "shared-up": 170,  # + test_prometheus_real (two Prometheus starts, ~20 s)
    "tests/local/test_scale_under_load.py": 85,
    "tests/local/test_bench_chaos.py": 65,  # 88 before the slow-reader and hang cuts
    "tests/local/test_up_resilience.py": 120,
    "tests/planner/test_local_up_autoscale.py": 60,
    "tests/planner/test_sim_vs_real.py": 55,
    "tests/engine/test_triton_attention.py": 45,
    "tests/local/test_up_lone_decode.py": 40,
    "tests/router/test_e2e.py": 40,
    "tests/local/test_smollm2.py": 35,
    "tests/engine/test_speculative_bench_quick.py": 50,
    "tests/router/test_up_kv_shared.py": 35,  # pdserve up, 2 prefill + 1 decode + redis
    "tests/engine/test_spec_draft.py": 25,
    "tests/test_router_extra.py": 40,  # a fresh venv with .[router] (uv, cache warm)
    "edge-deployment": 35,
    # From a whole -n 2 run's 15 slowest (2026-12-03, load ~15-20, setup + call): bench
    # quick runs, which the tier guess (20 s a module) put at the end of the order.
    "tests/engine/test_serve_bench_quick.py": 100,
    "tests/router/test_bench_stream_overhead.py": 80,
    "tests/router/test_bench_routing.py": 60,
    "tests/router/test_bench_router_throughput.py": 60,
    "tests/router/test_multi_router_bench.py": 50,
    "tests/engine/test_compile_cache_host.py": 45,
    "tests/planner/test_planner_simulate.py": 30,  # 47 before the mean_lengths cache
    "tests/router/test_lora_bench.py": 45,
    "tests/workers/test_worker_faults.py": 45,
    # a real compile of the tiny model, in the background (inductor cache warm: ~40 CPU-s)
    "tests/engine/test_compile_swap.py": 40,
    "tests/workers/test_worker_probe.py": 30,  # two worker starts, plain processes
    # every served family (25) through a real compile, inductor's cache warm: 214 CPU-s,
    # 226 s alone at load ~2 (docs/testing.md, "The compiled family matrix")
    "tests/engine/test_family_compiled.py": 230,
}
# The guess: a start per module (a bench script's run, a cluster) plus seconds per test.
MODULE_SECONDS = {"unit": 0.0, "k8s": 0.0, "cluster": 10.0, "bench": 20.0, "k8s_real": 30.0}
TEST_SECONDS = {"unit": 0.1, "k8s": 0.3, "cluster": 3.0, "bench": 0.5, "k8s_real": 5.0}


def group_of(item: pytest.Item) -> str:
    if "k8s_real" in item.path.parts:
        return "k8s-real"
    fixtures = set(getattr(item, "fixturenames", ()))
    for fixture, group in SHARED_SERVICES.items():
        if fixture in fixtures:
            return group
    return item.nodeid.split("::", 1)[0]


def plan(items: list[pytest.Item], loadgroup: bool = False) -> None:
    """Mark each item's group; under xdist, order the groups longest first (in place);
    under ``--dist loadgroup``, name each item's group in its node id (see ``_name_group``)."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = group_of(item)
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
        if loadgroup:
            _name_group(item, group)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run: collection order

    def cost(group: str) -> float:
        if group in KNOWN_SECONDS:
            return KNOWN_SECONDS[group]
        tiers = [tier_of(item) for item in groups[group]]
        return sum(TEST_SECONDS[t] for t in tiers) + sum(MODULE_SECONDS[t] for t in set(tiers))

    # sorted() is stable and the collection is the same on every worker: one order for all.
    items[:] = [item for group in sorted(groups, key=cost, reverse=True) for item in groups[group]]


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
