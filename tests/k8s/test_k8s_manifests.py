"""Chart and rendered manifests: helm lint/template, kubernetes-validate (strict), CRD schema.

helm and kubectl come from scripts/install_k8s_tools.sh (run by scripts/setup.sh);
these tests fail, not skip, when they are missing.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_helpers import ROOT, schema_errors

from pdserve.operator.render import render

pytestmark = pytest.mark.timeout(300)

CHART = ROOT / "charts" / "pdserve"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSIONS = ("1.29.0", "1.31.0", "1.34.0")  # helm --kube-version
# kubernetes-validate ships schemas per minor version; every one in 1.29-1.34 is checked.
VALIDATE_VERSIONS = tuple(f"1.{m}" for m in range(29, 35))
LLMSERVICE_FILES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(
    (pathlib.Path(__file__).parent / "fixtures").glob("*.yaml")
)


@functools.cache
def tool(name: str) -> str:
    local = ROOT / ".venv" / "bin" / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} not found: run `bash scripts/install_k8s_tools.sh` (puts it in .venv/bin)"
        )
    return found


def run(*args: str) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def helm_template(values: pathlib.Path | None, kube_version: str) -> list[dict[str, Any]]:
    args = [tool("helm"), "template", "rel", str(CHART), "-n", "pdserve-system", "--include-crds"]
    args += ["--kube-version", kube_version] + (["-f", str(values)] if values else [])
    return [d for d in yaml.safe_load_all(run(*args)) if d]


def validate_builtin(doc: dict[str, Any]) -> None:
    for version in VALIDATE_VERSIONS:
        error = _schema_error(json.dumps(doc, sort_keys=True), version)
        if error:
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            pytest.fail(f"{name} invalid for Kubernetes {version}: {error}")


@functools.cache
def _schema_error(doc_json: str, version: str) -> str:
    """kubernetes-validate's verdict on one document (as canonical JSON) for one version,
    once per module: most documents render the same for every values file and every
    ``--kube-version``, and the 15 renderings' strict checks were a minute of the suite."""
    try:
        kubernetes_validate.validate(json.loads(doc_json), version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{e.message} at {list(e.path)}"
    return ""


def validate_doc(doc: dict[str, Any]) -> None:
    if doc["kind"] == "LLMService":
        assert schema_errors(doc) == [], doc["metadata"]["name"]
    elif doc["kind"] in ("KopfPeering", "ClusterKopfPeering"):
        # kopf's peering objects: no spec; kopf writes the peers into status.
        assert doc["apiVersion"] == "kopf.dev/v1" and set(doc) == {"apiVersion", "kind", "metadata"}
    elif doc["kind"] == "ServiceMonitor":
        # No schema ships for Prometheus Operator CRDs: check the fields we rely on.
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        # Workers on http; the router on its admin port (its http /metrics needs a key).
        http, admin = doc["spec"]["endpoints"]
        assert (http["port"], admin["port"]) == ("http", "admin")
        assert http["relabelings"] == [
            {
                "sourceLabels": ["__meta_kubernetes_service_label_pdserve_io_role"],
                "regex": "router",
                "action": "drop",
            }
        ]
        assert (
            doc["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"]
            == "pdserve-operator"
        )
    else:
        validate_builtin(doc)


def test_helm_binaries_work() -> None:
    assert run(tool("helm"), "version", "--short").startswith("v")
    assert "Client Version" in run(tool("kubectl"), "version", "--client")


@pytest.mark.parametrize("values", [None, *VALUES], ids=lambda v: v.name if v else "default")
def test_helm_lint_strict(values: pathlib.Path | None) -> None:
    run(tool("helm"), "lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [None, *VALUES], ids=lambda v: v.name if v else "default")
def test_helm_template_validates(values: pathlib.Path | None, kube_version: str) -> None:
    docs = helm_template(values, kube_version)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "ClusterRole"} <= kinds
    for doc in docs:
        validate_doc(doc)


def test_chart_crd_is_the_operator_crd() -> None:
    docs = helm_template(None, KUBE_VERSIONS[-1])
    crds = [
        d
        for d in docs
        if d["kind"] == "CustomResourceDefinition"
        and d["metadata"]["name"] == "llmservices.pdserve.io"
    ]
    with open(CHART / "crds" / "llmservices.pdserve.io.yaml", encoding="utf-8") as f:
        assert crds == [yaml.safe_load(f)]


def test_values_schema_refuses_bad_values() -> None:
    for bad in (
        "operator.replicas=0",
        "image.pullPolicy=Sometimes",
        "operator.watchNamespaces[0]=Bad_NS",
    ):
        args = [tool("helm"), "template", "rel", str(CHART), "--set", bad]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode != 0 and "values don't meet the specifications" in proc.stderr, bad


def test_operator_is_highly_available_with_peering() -> None:
    modes = [
        ("cluster-wide-values.yaml", "ClusterKopfPeering"),
        ("namespaced-values.yaml", "KopfPeering"),
        (None, "KopfPeering"),
    ]
    for values, kind in modes:
        docs = helm_template(CHART / "ci" / values if values else None, KUBE_VERSIONS[-1])
        op = next(d for d in docs if d["kind"] == "Deployment")
        assert op["spec"]["replicas"] >= 2 and op["spec"]["strategy"]["type"] == "RollingUpdate"
        cmd = op["spec"]["template"]["spec"]["containers"][0]["command"]
        peering = next(c.split("=", 1)[1] for c in cmd if c.startswith("--peering="))
        objs = [d for d in docs if d["kind"] == kind]
        assert objs and all(d["metadata"]["name"] == peering for d in objs)
        rules = [r for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]]
        plural = kind.lower() + "s"
        assert any(plural in r["resources"] and "patch" in r["verbs"] for r in rules), kind
        crds = {d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"}
        assert {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds


def test_namespaced_mode_has_no_cluster_wide_write_access() -> None:
    docs = helm_template(CHART / "ci" / "namespaced-values.yaml", KUBE_VERSIONS[-1])
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["llm-prod", "llm-staging"]
    for cluster_role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in cluster_role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
            assert "namespaces" not in rule["resources"]
    op = next(d for d in docs if d["kind"] == "Deployment")
    cmd = op["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[:2] == ["pdserve", "operator"]
    assert "--namespace=llm-prod" in cmd and "--all-namespaces" not in cmd
    secrets = [r for r in roles[0]["rules"] if "secrets" in r["resources"]]
    assert [r["verbs"] for r in secrets] == [
        ["create"]
    ]  # no get, list or watch of Secrets (issue 44 item 12)
    finalizers = [r for r in roles[0]["rules"] if "llmservices/finalizers" in r["resources"]]
    assert [r["verbs"] for r in finalizers] == [["update"]]  # OwnerReferencesPermissionEnforcement


@pytest.mark.parametrize("path", LLMSERVICE_FILES, ids=lambda p: p.name)
def test_llmservice_files_valid_and_render_valid(path: pathlib.Path) -> None:
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    assert docs
    for doc in docs:
        assert schema_errors(doc) == [], path.name
        for manifest in render(doc):
            validate_builtin(manifest)


def test_sample_llmservice_matches_cpu_example() -> None:
    docs = helm_template(CHART / "ci" / "sample-values.yaml", KUBE_VERSIONS[-1])
    sample = next(d for d in docs if d["kind"] == "LLMService")
    with open(ROOT / "examples" / "llmservice-cpu.yaml", encoding="utf-8") as f:
        example = yaml.safe_load(f)
    spec = {k: v for k, v in sample["spec"].items() if k not in ("image", "imagePullPolicy")}
    assert spec == {k: v for k, v in example["spec"].items() if k != "image"}


def test_dashboard_uses_contract_metrics() -> None:
    with open(CHART / "dashboards" / "pdserve.json", encoding="utf-8") as f:
        dash = json.load(f)
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    used = set(re.findall(r"\b(pdserve_[a-z_]+?)(?:_bucket|_sum|_count)?\{", exprs))
    contract = set(
        re.findall(r"`(pdserve_[a-z_]+)", (ROOT / "docs" / "architecture.md").read_text())
    )
    assert used <= contract, f"metrics not in docs/architecture.md: {used - contract}"
    needed = ["ttft", "tpot", "itl", "e2e", "requests_total", "routing_decisions", "prefix_match"]
    needed += ["kv_blocks_free", "kv_blocks_total", "transfer_bytes", "transfer_seconds"]
    needed += ["lease_expired", "requests_running", "requests_waiting"]
    assert [n for n in needed if n not in exprs] == []
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_dockerfile_copies_every_package_folder() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    folders = set(re.findall(r'"pdserve\.\w+" = "(\w+)"', pyproject)) | {"pdserve"}
    for folder in folders:
        assert f"COPY {folder}/ {folder}/" in dockerfile, folder
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "pdserve"]' in dockerfile


def test_crd_upgrade_hook_is_opt_in_least_privilege_and_runs_crds_apply() -> None:
    assert not [
        d
        for d in helm_template(None, KUBE_VERSIONS[-1])
        if "helm.sh/hook" in d["metadata"].get("annotations", {})
    ]
    docs = helm_template(CHART / "ci" / "crd-upgrade-values.yaml", KUBE_VERSIONS[-1])
    hooks = {d["kind"]: d for d in docs if "helm.sh/hook" in d["metadata"].get("annotations", {})}
    assert set(hooks) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"}
    for d in hooks.values():
        notes = d["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert "before-hook-creation" in notes["helm.sh/hook-delete-policy"]
    weight = {k: int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for k, d in hooks.items()}
    assert weight["Job"] > max(w for k, w in weight.items() if k != "Job")  # RBAC first
    crd_names = sorted(
        d["metadata"]["name"] for d in docs if d["kind"] == "CustomResourceDefinition"
    )
    rules = hooks["ClusterRole"]["rules"]
    assert [(r["verbs"], sorted(r.get("resourceNames", []))) for r in rules] == [
        (["get", "patch"], crd_names),
        (["create"], []),
    ]
    assert all(r["resources"] == ["customresourcedefinitions"] for r in rules)
    sa = hooks["ServiceAccount"]["metadata"]["name"]
    binding = hooks["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == hooks["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa, "namespace": "pdserve-system"}
    ]
    pod = hooks["Job"]["spec"]["template"]["spec"]
    operator = next(d for d in docs if d["kind"] == "Deployment")
    op_container = operator["spec"]["template"]["spec"]["containers"][0]
    (container,) = pod["containers"]
    assert container["command"] == ["pdserve", "crds", "apply"]
    assert container["image"] == op_container["image"]  # the release's (operator) image
    assert pod["serviceAccountName"] == sa and pod["restartPolicy"] == "Never"
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for d in hooks.values():
        validate_builtin(d)


def test_packaged_crds_are_the_charts() -> None:
    """`pdserve crds apply` applies pdserve/crds: the chart's crds/ folder (pyproject maps it)."""
    from pdserve.operator.crds_cli import PACKAGED

    assert PACKAGED.resolve() == (CHART / "crds").resolve()
    assert '"pdserve.crds" = "charts/pdserve/crds"' in (ROOT / "pyproject.toml").read_text()
    assert "COPY charts/pdserve/crds/ charts/pdserve/crds/" in (ROOT / "Dockerfile").read_text()
