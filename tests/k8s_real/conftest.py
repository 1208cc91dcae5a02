"""The k8s_real tier's fixtures: one real control plane per run (tests/xdist_plan.py keeps the
tier in one xdist group), the chart installed by the real helm, the operator as a process.

Binaries: scripts/build_k8s.py (make test builds them first; KUBEBUILDER_ASSETS is honoured).
Without them a plain pytest run skips the tier saying how to build them; under make test
(PDSERVE_REQUIRE_K8S_REAL=1, scripts/test.sh) a missing binary fails the tier instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.testing.k8s_real.cluster import (
    CHART,
    RELEASE,
    SYSTEM_NS,
    OperatorProcess,
    RealCluster,
)
from pdserve.testing.k8s_real.control_plane import ControlPlane, find_binaries
from pdserve.testing.k8s_real.fake_kubelet import FakeKubelet, create_nodes
from tests.early_release import released_after_last_user

# The namespaces the shared operator watches (operator.watchNamespaces): the examples' own
# (default: the CPU example, restricted; llm: the GPU example, privileged since it asks for
# IPC_LOCK, which baseline refuses too) and the tests' (llm-a, llm-b: restricted).
WATCHED = {
    "default": "restricted",
    "llm": "privileged",
    "llm-a": "restricted",
    "llm-b": "restricted",
}

MODELS_PVC = json.dumps(
    {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "models"},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
)


def _binaries() -> Path:
    found = find_binaries()
    if found is not None:
        return found
    msg = (
        "k8s_real: no etcd/kube-apiserver/kube-controller-manager: run "
        "`python scripts/build_k8s.py` (once per machine) or set KUBEBUILDER_ASSETS"
    )
    if os.environ.get("PDSERVE_REQUIRE_K8S_REAL"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    work = Path(tempfile.mkdtemp(prefix="pdserve-k8s-real-"))
    plane = ControlPlane(work, _binaries())
    try:
        plane.start()
    except Exception:
        logs = "\n".join(f"--- {n}\n{plane.logs(n)}" for n in plane.procs)
        plane.stop()
        raise AssertionError(f"control plane did not start in {work}:\n{logs}") from None
    api = plane.client()
    create_nodes(api)
    kubelet = FakeKubelet(api=plane.client(), stream=plane.client()).start()
    cluster = RealCluster(plane, kubelet)
    with released_after_last_user("real_cluster") as stack:  # tests/early_release.py
        stack.callback(plane.stop, kill=True)  # its last user is done: nothing to drain
        stack.callback(kubelet.close)
        yield cluster


@pytest.fixture(scope="session")
def chart(real_cluster: RealCluster) -> RealCluster:
    """``helm install pdserve charts/pdserve`` into pdserve-system, watching llm-a (both
    namespaces enforce PodSecurity restricted)."""
    real_cluster.namespace(SYSTEM_NS)
    for ns, level in WATCHED.items():
        real_cluster.namespace(ns, level)
    real_cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NS,
        f"--set=operator.watchNamespaces={{{','.join(WATCHED)}}}",
        "--wait=false",
        timeout=120,
    )
    for ns in ("llm-a", "llm-b"):  # the tests' LLMServices read their model from this PVC
        real_cluster.kubectl("apply", "-n", ns, "-f", "-", stdin=MODELS_PVC)
    real_cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/llmservices.pdserve.io",
        "crd/kopfpeerings.kopf.dev",
    )
    # The controller manager's garbage collector learns new resource types from discovery
    # every 30 s (a constant in kube-controller-manager): until then it watches no
    # LLMService, and a deleted one's children wait up to 30 s. Started again now, it
    # watches them from the start, as on a cluster where the chart was installed earlier.
    real_cluster.plane.restart("kube-controller-manager")
    return real_cluster


@pytest.fixture(scope="session")
def operator(chart: RealCluster) -> Iterator[OperatorProcess]:
    """The shared operator (peering as shipped: the chart's KopfPeering in each namespace)."""
    op = OperatorProcess(chart, list(WATCHED))
    with released_after_last_user("operator") as stack:  # before the control plane's
        stack.callback(op.stop)
        yield op
