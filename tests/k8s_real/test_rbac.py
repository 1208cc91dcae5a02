"""Item 2 of issue 42: the chart's ServiceAccount gets exactly what the chart grants. The
shared operator reconciles under it (test_apply.py); here the API server refuses what the
chart does not grant, as RBAC on a real cluster does."""

from __future__ import annotations

from pdserve.testing.k8s_real.cluster import OPERATOR_SA, SYSTEM_NS, RealCluster


def test_chart_service_account_is_refused_what_the_chart_does_not_grant(chart: RealCluster) -> None:
    c = chart
    sa = c.plane.client(c.token(OPERATOR_SA, SYSTEM_NS))
    # granted (namespaced mode, watched namespace llm-a): read its own kinds
    assert sa.get("/apis/apps/v1/namespaces/llm-a/deployments").status_code == 200
    assert sa.get("/apis/pdserve.io/v1alpha1/namespaces/llm-a/llmservices").status_code == 200
    refused = {
        # Secrets: create only, never read, even by name (issue 44 item 12)
        "get a secret in a watched namespace": sa.get("/api/v1/namespaces/llm-a/secrets/none"),
        # Secrets are get/create by name only: never list (it would read every Secret)
        "list secrets in a watched namespace": sa.get("/api/v1/namespaces/llm-a/secrets"),
        # outside the watched namespaces: nothing
        "get a secret in kube-system": sa.get("/api/v1/namespaces/kube-system/secrets/x"),
        "list deployments in kube-system": sa.get(
            "/apis/apps/v1/namespaces/kube-system/deployments"
        ),
        "create a deployment in kube-system": sa.post(
            "/apis/apps/v1/namespaces/kube-system/deployments",
            json={"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}},
        ),
        # cluster-scoped writes: none
        "create a namespace": sa.post(
            "/api/v1/namespaces",
            json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}},
        ),
        "bind cluster-admin": sa.post(
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            json={
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": "x"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "cluster-admin",
                },
                "subjects": [],
            },
        ),
    }
    for what, resp in refused.items():
        assert resp.status_code == 403, f"{what}: {resp.status_code} {resp.text[:300]}"
        assert f"system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}" in resp.json()["message"]
    # kubectl says the same, as a cluster admin checking the chart would ask it
    can = c.kubectl(
        "auth",
        "can-i",
        "list",
        "secrets",
        "-n",
        "llm-a",
        f"--as=system:serviceaccount:{SYSTEM_NS}:{OPERATOR_SA}",
        check=False,
    )
    assert can.stdout.strip() == "no", can.stdout + can.stderr
