"""The suite's tiers, one marker per test: ``unit``, ``cluster``, ``bench``, ``k8s``, ``k8s_real``.

``make test-fast`` runs ``-m unit`` (the inner loop); ``make test`` runs every tier. Every
test file declares its tier (``pytestmark = pytest.mark.unit``, a test of another tier marked
itself; tests/test_tiers.py fails on a file without one); tests/k8s/ and tests/k8s_real/
are theirs by directory. What follows is the rule the declarations follow, and the fallback
for a test that has none (a test defined in a helper module):

- ``k8s_real``: under tests/k8s_real/ (a real etcd, kube-apiserver and controller-manager);
- ``k8s``: under tests/k8s/ (the operator against a Kubernetes API emulator);
- ``bench``: runs a script of bench/ (``run_bench``), or its file is named for a bench;
- ``cluster``: starts real services: a fixture that does (``up``, ``deployment``), or its
  module uses a helper that does (``LocalCluster``, ``worker_cluster``, ``run_up``, and
  ``start_up``/``running_up`` of pdserve.testing.up), or it is one of ``CLUSTER_MODULES``;
- ``unit``: everything else (in-process; fakes on loopback at most).

A test's own marker wins over its module's.
"""

from __future__ import annotations

import pytest

TIERS = {
    "unit": "in-process tests, seconds each (make test-fast)",
    "cluster": "tests that start real routers or workers on loopback",
    "bench": "tests that run a benchmark script's --quick mode",
    "k8s": "operator and chart tests against a Kubernetes API emulator",
    "k8s_real": "chart, CRD and operator tests against a real kube-apiserver, etcd and "
    "kube-controller-manager (scripts/build_k8s.py)",
}
CLUSTER_FIXTURES = frozenset({"up", "deployment"})
CLUSTER_HELPERS = frozenset({"LocalCluster", "worker_cluster", "run_up", "start_up", "running_up"})
# Modules that start `python -m pdserve up` / `router` with their own Popen.
CLUSTER_MODULES = frozenset({"test_local_up_autoscale", "test_router_process"})


def tier_of(item: pytest.Item) -> str:
    own = [m.name for m in item.iter_markers() if m.name in TIERS]
    return own[0] if own else inferred_tier(item)


def inferred_tier(item: pytest.Item) -> str:
    """The tier from what the test uses, whatever it declares."""
    path = item.path
    if "k8s_real" in path.parts:
        return "k8s_real"
    if "k8s" in path.parts:
        return "k8s"
    module = getattr(item, "module", None)
    names = vars(module) if module is not None else {}
    if "run_bench" in names or "bench" in path.stem:
        return "bench"
    fixtures = set(getattr(item, "fixturenames", ()))
    if path.stem in CLUSTER_MODULES or fixtures & CLUSTER_FIXTURES:
        return "cluster"
    if CLUSTER_HELPERS & names.keys():
        return "cluster"
    return "unit"


def mark_tiers(items: list[pytest.Item]) -> None:
    """Each test's tier marker. A test declared ``unit`` that starts a cluster or runs a bench
    (as far as ``inferred_tier`` sees) is refused: ``make test-fast`` would run it."""
    wrong = []
    for item in items:
        tier = tier_of(item)
        if tier == "unit" and inferred_tier(item) != "unit":
            wrong.append(f"{item.nodeid} (uses a {inferred_tier(item)} fixture or helper)")
        if not any(m.name == tier for m in item.iter_markers()):
            item.add_marker(tier)
    if wrong:
        raise pytest.UsageError("declared unit, but not in-process: " + "; ".join(wrong))
