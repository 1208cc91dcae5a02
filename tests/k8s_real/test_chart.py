"""Item 1 of issue 42: the real helm installs, upgrades and uninstalls charts/pdserve on a real
API server (RBAC on, PodSecurity restricted enforced on the release namespace)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from pdserve.testing.k8s_real.cluster import CHART, RealCluster

NS = "pdserve-other"
RELEASE = "other"
OP = "other-pdserve-operator"  # <release>-<chart>-operator


def _chart_with_new_field(tmp: Path) -> Path:
    """A copy of the chart whose LLMService CRD gained an optional spec field."""
    copy = tmp / "pdserve"
    shutil.copytree(CHART, copy)
    crd_path = copy / "crds" / "llmservices.pdserve.io.yaml"
    crd = yaml.safe_load(crd_path.read_text())
    for version in crd["spec"]["versions"]:
        spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec["properties"]["k8sRealProbe"] = {"type": "string", "maxLength": 20}
    crd_path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return copy


def _cr(name: str, extra: dict[str, str] | None = None) -> str:
    spec = {
        "image": "ghcr.io/pdserve/pdserve:test",
        "model": {"source": {"pvc": {"claimName": "models", "path": "/m"}}},
        **(extra or {}),
    }
    return yaml.safe_dump(
        {
            "apiVersion": "pdserve.io/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": name, "namespace": NS},
            "spec": spec,
        }
    )


def test_helm_install_upgrade_uninstall(chart: RealCluster, tmp_path: Path) -> None:
    c = chart
    c.namespace(NS)
    c.helm("install", RELEASE, str(CHART), "-n", NS, "--wait=false", timeout=120)
    for crd in ("llmservices.pdserve.io", "kopfpeerings.kopf.dev"):
        got = c.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}")
        assert got is not None
        assert any(
            x["type"] == "Established" and x["status"] == "True"
            for x in got["status"]["conditions"]
        )
    assert c.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{OP}") is not None
    assert c.get(f"/api/v1/namespaces/{NS}/serviceaccounts/{OP}") is not None
    assert c.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/{OP}") is not None
    assert c.get(f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings/{OP}") is not None
    # the controller-manager makes the operator's pods; PodSecurity restricted admits them
    sel = "app.kubernetes.io/instance=other,app.kubernetes.io/component=operator"
    c.wait(
        lambda: len(c.items(f"/api/v1/namespaces/{NS}/pods", sel)) == 2,
        60,
        what="two operator pods admitted under restricted",
    )
    c.kubectl("apply", "-f", "-", stdin=_cr("before"))

    # upgrade: the new CRD goes in first (docs/kubernetes.md "Upgrade"), then helm upgrade
    new_chart = _chart_with_new_field(tmp_path)
    c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(new_chart / "crds"))
    c.helm("upgrade", RELEASE, str(new_chart), "-n", NS, "--wait=false", timeout=120)
    c.kubectl("apply", "-f", "-", stdin=_cr("after", {"k8sRealProbe": "kept"}))
    after = c.get(f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices/after")
    assert after is not None and after["spec"]["k8sRealProbe"] == "kept"  # not pruned
    before = c.get(f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices/before")
    assert before is not None and before["spec"]["model"]["source"]["pvc"]["claimName"] == "models"

    c.helm("uninstall", RELEASE, "-n", NS, "--wait", timeout=120)
    assert c.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{OP}") is None
    assert c.get(f"/api/v1/namespaces/{NS}/serviceaccounts/{OP}") is None
    assert c.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{OP}-discovery") is None
    assert c.get(f"/apis/kopf.dev/v1/namespaces/{NS}/kopfpeerings/{OP}") is None
    # kept, as docs/kubernetes.md says: the CRDs (and so the LLMServices in them)
    assert c.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/llmservices.pdserve.io")
    c.kubectl("delete", "llmservices", "--all", "-n", NS, "--wait=true")
    c.wait(lambda: not c.items(f"/api/v1/namespaces/{NS}/pods"), 60, what="operator pods gone")
