"""What the k8s_real tests do as a cluster user: kubectl, helm, the operator as a process.

``RealCluster`` holds the control plane (control_plane.py), the fake kubelet and an admin
kubeconfig; ``kubectl``/``helm`` run the real binaries (scripts/install_k8s_tools.sh puts
them into .venv/bin). ``OperatorProcess`` runs ``pdserve operator`` as a process that logs in
with a ServiceAccount token (a kubeconfig, as kube.login reads it), not as admin.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pdserve.local.proc_group import end_group, poll_until
from pdserve.testing.k8s_real.control_plane import ControlPlane
from pdserve.testing.k8s_real.fake_kubelet import FakeKubelet
from pdserve.testing.loopback import ROOT, free_port

BIN = Path(sys.executable).parent
CHART = ROOT / "charts" / "pdserve"
SYSTEM_NS = "pdserve-system"  # the chart's release namespace
RELEASE = "pdserve"
OPERATOR_SA = "pdserve-operator"  # the chart's ServiceAccount (release pdserve)


def pod_security(level: str) -> dict[str, str]:
    """The namespace labels with which PodSecurity admission enforces ``level``."""
    return {
        "pod-security.kubernetes.io/enforce": level,
        "pod-security.kubernetes.io/enforce-version": "latest",
    }


class RealCluster:
    def __init__(self, plane: ControlPlane, kubelet: FakeKubelet) -> None:
        self.plane, self.kubelet = plane, kubelet
        self.api = plane.client()
        self.admin_kubeconfig = plane.kubeconfig("admin")

    def run(
        self,
        tool: str,
        *args: str,
        kubeconfig: Path | None = None,
        stdin: str | None = None,
        check: bool = True,
        timeout: float = 90,
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(kubeconfig or self.admin_kubeconfig)}
        env.update(
            HELM_CACHE_HOME=str(self.plane.work / "helm-cache"),
            HELM_CONFIG_HOME=str(self.plane.work / "helm-config"),
            HELM_DATA_HOME=str(self.plane.work / "helm-data"),
        )
        out = subprocess.run(
            [str(BIN / tool), *args],
            input=stdin,
            env=env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} failed ({out.returncode}):\n"
                f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
            )
        return out

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kw)

    def helm(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kw)

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.api.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def items(self, path: str, selector: str = "") -> list[dict[str, Any]]:
        r = self.api.get(path, params={"labelSelector": selector} if selector else None)
        r.raise_for_status()
        return r.json()["items"]  # type: ignore[no-any-return]

    def namespace(self, name: str, level: str = "restricted") -> None:
        """Create (or label) ``name``, PodSecurity enforcing ``level`` there."""
        meta = {"name": name, "labels": pod_security(level)}
        r = self.api.post(
            "/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": meta}
        )
        if r.status_code == 409:
            r = self.api.patch(
                f"/api/v1/namespaces/{name}",
                content=json.dumps({"metadata": meta}),
                headers={"Content-Type": "application/merge-patch+json"},
            )
        assert r.status_code in (200, 201), r.text

    def token(self, sa: str, namespace: str) -> str:
        """A bound token for ``sa`` (TokenRequest, what the kubelet mounts into a pod)."""
        r = self.api.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
            json={
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {"expirationSeconds": 3600},
            },
        )
        assert r.status_code == 201, r.text
        return r.json()["status"]["token"]  # type: ignore[no-any-return]

    def wait(self, check: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
        return poll_until(check, timeout, interval=0.25, what=what or "the condition")

    def apply_object(self, namespace: str, obj: dict[str, Any]) -> None:
        """``kubectl apply`` of one object (a dict, as JSON) in ``namespace``."""
        self.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(obj))


class OperatorProcess:
    """``pdserve operator`` under the chart's ServiceAccount token, as its pod would run it
    (kopf peering as the chart ships it: the KopfPeering ``pdserve-operator``)."""

    def __init__(
        self, cluster: RealCluster, namespaces: list[str], name: str = "op", priority: int = 100
    ) -> None:
        self.cluster, self.namespaces, self.name = cluster, namespaces, name
        self.priority = priority
        self.log_path = cluster.plane.work / f"operator-{name}.log"
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        token = self.cluster.token(OPERATOR_SA, SYSTEM_NS)  # a fresh token, as a new pod gets
        kubeconfig = self.cluster.plane.kubeconfig(f"sa-{self.name}", token, self.namespaces[0])
        argv = [
            sys.executable,
            "-m",
            "pdserve",
            "operator",
            *(f"--namespace={ns}" for ns in self.namespaces),
            "--peering=pdserve-operator",
            f"--priority={self.priority}",
            f"--health-port={free_port()}",
            "--retry-delay=2",
            "--default-image=ghcr.io/pdserve/pdserve:test",
        ]
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def kill(self) -> None:
        """SIGKILL: the pod's node died (no peering record removed, no cleanup)."""
        end_group(self.proc, sig=9, grace_s=5)

    def restart(self) -> None:
        """A new pod replaces it: a higher peering priority than the dead one's record, so
        it acts at once instead of waiting for that record to expire."""
        self.kill()
        self.priority += 1
        self.proc = self._spawn()

    def stop(self) -> None:
        end_group(self.proc, grace_s=20)


def apply_yaml(
    cluster: RealCluster, text: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("apply", "-f", "-", stdin=text, check=check)


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def is_ready(obj: dict[str, Any] | None) -> bool:
    """Whether the object's Ready condition is True (no object: not ready)."""
    return conditions(obj or {}).get("Ready", {}).get("status") == "True"


def llmservice(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """An LLMService of the tiny model on the ``models`` PVC, with ``spec`` beside it."""
    model = {"source": {"pvc": {"claimName": "models", "path": "m"}}}
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": model, **spec},
    }


def read_only_pvc(name: str, storage: str) -> dict[str, Any]:
    """A ReadOnlyMany PersistentVolumeClaim (a model volume an LLMService names)."""
    spec = {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": storage}}}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": spec,
    }


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:3000]


def settle(seconds: float) -> None:
    time.sleep(seconds)


def scrape(plane: ControlPlane) -> str:
    r = httpx.get(
        plane.url + "/metrics",
        verify=False,
        timeout=10,
        headers={"Authorization": f"Bearer {plane_admin_token()}"},
    )
    r.raise_for_status()
    return r.text


def plane_admin_token() -> str:
    from pdserve.testing.k8s_real.control_plane import ADMIN_TOKEN

    return ADMIN_TOKEN
