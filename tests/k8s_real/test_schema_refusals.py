"""Item 4 of issue 42: the CRD's schema refuses an invalid spec at ``kubectl apply`` time,
naming the field; hostile podTemplates (``null`` values inside the schema's
x-kubernetes-preserve-unknown-fields, ``capabilities: {drop: []}``, ``runAsNonRoot: null``)
never become a pod that runs weaker than the rendered one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.testing.k8s_real.cluster import OperatorProcess, RealCluster, conditions

NS = "llm-a"
PATH = f"/apis/pdserve.io/v1alpha1/namespaces/{NS}/llmservices"


def svc(name: str, **spec: Any) -> str:
    body = {"model": {"source": {"pvc": {"claimName": "models", "path": "m"}}}, **spec}
    return json.dumps(
        {
            "apiVersion": "pdserve.io/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": name, "namespace": NS},
            "spec": body,
        }
    )


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"router": {"serviceType": "Bogus"}}, "spec.router.serviceType"),
        ({"prefill": {"replicas": -1}}, "spec.prefill.replicas"),
        ({"decode": {"replicas": 5, "maxReplicas": 2}}, "spec.decode"),
        ({"model": {"source": {}}}, "spec.model.source"),
    ],
)
def test_schema_refuses_at_apply_naming_the_field(
    chart: RealCluster, spec: dict[str, Any], field: str
) -> None:
    out = chart.kubectl("apply", "-f", "-", stdin=svc("invalid", **spec), check=False)
    assert out.returncode != 0, out.stdout
    assert field in out.stderr, out.stderr
    assert chart.get(f"{PATH}/invalid") is None


HOSTILE = {
    "run-as-root": {"spec": {"securityContext": {"runAsNonRoot": None}}},
    "caps-kept": {
        "spec": {
            "containers": [{"name": "decode", "securityContext": {"capabilities": {"drop": []}}}]
        }
    },
    "nulls": {
        "spec": {
            "securityContext": None,
            "containers": [
                {
                    "name": "decode",
                    "securityContext": {"allowPrivilegeEscalation": None, "runAsNonRoot": None},
                }
            ],
        }
    },
}


def _weakened(pod: dict[str, Any]) -> list[str]:
    """What makes a rendered pod template weaker than PodSecurity restricted wants."""
    out = []
    if not (pod.get("securityContext") or {}).get("runAsNonRoot"):
        out.append("pod runAsNonRoot unset")
    for c in pod.get("containers", []):
        ctx = c.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or []):
            out.append(f"{c['name']}: capabilities.drop lacks ALL")
    return out


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_pod_templates_never_weaken_a_pod(
    chart: RealCluster, operator: OperatorProcess, name: str
) -> None:
    c = chart
    c.kubectl("apply", "-f", "-", stdin=svc(name, decode={"podTemplate": HOSTILE[name]}))
    stored = c.get(f"{PATH}/{name}")
    assert stored is not None
    # What the API server kept of the template (nulls inside preserve-unknown-fields):
    # printed for docs/kubernetes.md; the operator must refuse or restore, whatever it kept.
    print(name, "stored podTemplate:", json.dumps(stored["spec"]["decode"].get("podTemplate")))

    def settled() -> Any:
        obj = c.get(f"{PATH}/{name}") or {}
        conds = conditions(obj)
        dep = c.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}-decode")
        if conds.get("Degraded", {}).get("status") == "True":
            return ("refused", conds["Degraded"]["message"], dep)
        if dep is not None:
            return ("rendered", "", dep)
        return None

    verdict, message, dep = c.wait(settled, 60, what=f"{name}: the operator's answer")
    if verdict == "refused":
        assert "podTemplate" in message, message
        assert dep is None or not _weakened(dep["spec"]["template"]["spec"])
    else:
        assert not _weakened(dep["spec"]["template"]["spec"]), dep["spec"]["template"]["spec"]
    c.kubectl("delete", "llmservice", name, "-n", NS, "--wait=true")
