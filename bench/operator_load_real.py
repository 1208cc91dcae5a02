"""``operator_load.py --real``: the operator's API load measured by a real kube-apiserver.

The control plane of the k8s_real tier (tests/k8s_real/: etcd, kube-apiserver,
kube-controller-manager, fake nodes and kubelet), the chart installed by the real helm, and
the operator as shipped: two replicas with the chart's kopf peering, each a process under
the chart's ServiceAccount token. The fleet grows 1 -> 10 -> 100 LLMServices; once every
object is Ready and has settled, a steady-state window reads the API server's own
``apiserver_request_total`` before and after.

``api_requests_per_object_minute_at`` {N}: (requests in the window - the control plane's
own background, measured in a window before the operator started) / N / minutes. The
background (the API server's leases and endpoint reconciler, the controller-manager's
discovery, the fake kubelet's watch renewals) is printed apart, as are the raw counts by
resource and verb. Goal: <= 2 at 100 objects.

    python bench/operator_load.py --real                  # 1, 10, 100; 60 s windows
    python bench/operator_load.py --real --counts 1,10 --window 20
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.testing.k8s_real import cluster
from pdserve.testing.k8s_real.cluster import (
    CHART,
    RELEASE,
    SYSTEM_NS,
    OperatorProcess,
    RealCluster,
    is_ready,
    read_only_pvc,
)
from pdserve.testing.k8s_real.control_plane import ControlPlane, find_binaries
from pdserve.testing.k8s_real.fake_kubelet import FakeKubelet, create_nodes

NS = "llm-load"
SAMPLE = re.compile(r"^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$", re.M)


def request_counts(plane: ControlPlane) -> collections.Counter[str]:
    """apiserver_request_total by ``verb resource``, read from the API server's /metrics."""
    text = plane.client().get("/metrics").text
    out: collections.Counter[str] = collections.Counter()
    for labels, value in SAMPLE.findall(text):
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[f"{lab.get('verb', '?')} {lab.get('resource', '') or lab.get('group', '')}"] += int(
            float(value)
        )
    return out


def window(plane: ControlPlane, seconds: float) -> collections.Counter[str]:
    before = request_counts(plane)
    time.sleep(seconds)
    after = request_counts(plane)
    diff = after - before
    diff["GET "] -= 1  # the bench's own /metrics scrape that opened the window
    return +diff


# Resources no controller of the control plane (nor the fake kubelet) touches here.
OPERATOR_KINDS = frozenset(
    [
        "kopfpeerings",
        "llmservices",
        "configmaps",
        "secrets",
        "serviceaccounts",
        "roles",
        "rolebindings",
        "networkpolicies",
        "poddisruptionbudgets",
        "services",
        "events",
    ]
)


def operator_kinds(counts: collections.Counter[str]) -> int:
    """Requests in ``counts`` (``verb resource``) on the kinds only the operator uses."""
    return sum(v for key, v in counts.items() if key.partition(" ")[2] in OPERATOR_KINDS)


def llmservice(i: int) -> dict[str, Any]:
    return cluster.llmservice(f"svc-{i:03d}", NS)


def grow(c: RealCluster, first: int, n: int) -> None:
    for i in range(first, n):
        r = c.api.post(f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices", json=llmservice(i))
        assert r.status_code == 201, r.text

    def all_ready() -> bool:
        items = c.items(f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices")
        return sum(map(is_ready, items)) == n

    # ~5.5 min for 0 -> 100 on the shared 2-core machine at load ~17 (2026-12-07): the
    # bound leaves room for a busier one
    started = time.monotonic()
    c.wait(all_ready, 120 + 6 * n, what=f"{n} LLMServices Ready")
    print(
        f"operator_load --real: {n} LLMServices Ready in {time.monotonic() - started:.0f}s",
        file=sys.stderr,
        flush=True,
    )


def setup(work: Path) -> RealCluster:
    bins = find_binaries()
    if bins is None:
        raise SystemExit("operator_load --real: run `python scripts/build_k8s.py` first")
    plane = ControlPlane(work, bins).start()
    create_nodes(plane.client())
    c = RealCluster(plane, FakeKubelet(plane.client(), plane.client()).start())
    c.namespace(SYSTEM_NS)
    c.namespace(NS)
    c.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM_NS,
        f"--set=operator.watchNamespaces={{{NS}}}",
        "--wait=false",
        timeout=120,
    )
    c.apply_object(NS, read_only_pvc("models", "1Gi"))
    return c


def run_real(counts: list[int], window_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="pdserve-operator-load-real-"))
    c = setup(work)
    ops: list[OperatorProcess] = []
    try:
        time.sleep(5)  # the chart's objects and the controllers settle
        background = window(c.plane, window_s)
        bg_per_min = sum(background.values()) * 60 / window_s
        ops = [OperatorProcess(c, [NS], name=f"op{i}", priority=100 - i) for i in range(2)]
        rows, last = [], collections.Counter[str]()
        for n in counts:
            grow(c, rows[-1]["objects"] if rows else 0, n)
            time.sleep(5 + n / 10)  # status settles (Ready written once each)
            last = window(c.plane, window_s)
            per_min = sum(last.values()) * 60 / window_s
            row = {
                "objects": n,
                "requests_per_minute": round(per_min, 1),
                "api_requests_per_object_minute": round(max(0.0, per_min - bg_per_min) / n, 3),
                # no background to subtract: the kinds only the operator reads or writes (a
                # lower bound; the controllers' Deployment and Pod traffic is left out)
                "operator_kinds_requests_per_object_minute": round(
                    operator_kinds(last) * 60 / window_s / n, 3
                ),
            }
            rows.append(row)
            print(f"operator_load --real: {row}", file=sys.stderr, flush=True)
        alive = [o.name for o in ops if o.proc.poll() is None]
    finally:
        for o in ops:
            o.stop()
        c.kubelet.close()
        c.plane.stop()
    version = c.plane.version
    return {
        "server": "kube-apiserver",
        "server_version": version,
        "operator_replicas": len(ops),
        "operator_replicas_alive": len(alive),
        "peering": "pdserve-operator",
        "steady_window_s": window_s,
        "background_requests_per_minute": round(bg_per_min, 1),
        "api_requests_per_object_minute": rows[-1]["api_requests_per_object_minute"],
        "api_requests_per_object_minute_at": {
            str(r["objects"]): r["api_requests_per_object_minute"] for r in rows
        },
        "steady": rows,
        "last_window_by_verb_resource": dict(last.most_common(15)),
        "goal_met": rows[-1]["api_requests_per_object_minute"] <= 2.0
        if rows[-1]["objects"] >= 100
        else None,
    }
