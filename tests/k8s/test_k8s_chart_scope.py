"""The chart's reach: by default the operator watches its own namespace only (a Role
there; cluster-wide rules only read CRDs), cluster-wide mode must be asked for, and the
pod policy's opt-outs reach the operator's command line. Rendered with the real helm."""

from __future__ import annotations

import pathlib
import subprocess
from typing import Any

from test_k8s_manifests import CHART, KUBE_VERSIONS, helm_template, tool

RELEASE_NS = "pdserve-system"  # helm_template installs there


def _operator_command(docs: list[dict[str, Any]]) -> list[str]:
    op = next(d for d in docs if d["kind"] == "Deployment")
    return list(op["spec"]["template"]["spec"]["containers"][0]["command"])


def test_default_watches_only_the_release_namespace() -> None:
    docs = helm_template(None, KUBE_VERSIONS[-1])
    cmd = _operator_command(docs)
    assert f"--namespace={RELEASE_NS}" in cmd and "--all-namespaces" not in cmd
    roles = [d for d in docs if d["kind"] == "Role"]
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert [r["metadata"]["namespace"] for r in roles] == [RELEASE_NS]
    assert [b["metadata"]["namespace"] for b in bindings] == [RELEASE_NS]
    # Cluster-wide, the operator may only read CRDs: no namespaces, no writes anywhere else.
    cluster_rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert cluster_rules == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    # What the namespaced Role grants: no pod creation or exec, no Secret listing.
    rules = roles[0]["rules"]
    granted = {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}
    assert ("pods", "create") not in granted and ("pods/exec", "create") not in granted
    assert ("secrets", "list") not in granted and ("secrets", "watch") not in granted
    # nor get (issue 44 item 12): the operator reads no Secret; it creates its own one
    assert {verb for res, verb in granted if res == "secrets"} == {"create"}
    assert not any(r["kind"] == "ClusterKopfPeering" for r in docs)
    assert "--allow-unsafe-pod-fields" not in cmd


def test_cluster_wide_mode_is_explicit_and_excludes_a_namespace_list() -> None:
    docs = helm_template(CHART / "ci" / "cluster-wide-values.yaml", KUBE_VERSIONS[-1])
    assert "--all-namespaces" in _operator_command(docs)
    assert not [d for d in docs if d["kind"] == "Role"]
    args = [
        tool("helm"),
        "template",
        "rel",
        str(CHART),
        "--set",
        "operator.clusterWide=true",
        "--set",
        "operator.watchNamespaces={a}",
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "exclude each other" in proc.stderr


def test_pod_policy_values_reach_the_operator(tmp_path: pathlib.Path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text(
        "operator:\n  allowUnsafePodFields: true\n  allowedModelHostPaths: [/data/models]\n"
    )
    cmd = _operator_command(helm_template(values, KUBE_VERSIONS[-1]))
    assert "--allow-unsafe-pod-fields" in cmd
    assert "--allow-model-host-path=/data/models" in cmd
