"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager.

The binaries come from scripts/build_k8s.py (built once per machine from the Go module proxy,
or KUBEBUILDER_ASSETS). The API server authenticates bearer tokens from a token file (an admin
in ``system:masters``; service accounts by their signed tokens), authorizes with RBAC and runs
its default admission chain (PodSecurity included: namespaces opt into ``restricted`` by label).
There is no scheduler and no kubelet: fake_kubelet.py (beside this file) binds pods to fake nodes
and reports them Running/Ready, as kwok would.
"""

from __future__ import annotations

import signal
import ssl
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from pdserve.local.proc_group import end_group, poll_until
from pdserve.testing.loopback import ROOT, worker_port_base

ADMIN_TOKEN = "pdserve-k8s-real-admin"
KCM_TOKEN = "pdserve-k8s-real-kcm"
# Controllers a cluster user's objects meet (kube-controller-manager --controllers).
CONTROLLERS = (
    "garbage-collector-controller",
    "deployment-controller",
    "replicaset-controller",
    "endpointslice-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "namespace-controller",
    "disruption-controller",
    "root-ca-certificate-publisher-controller",
)


def assets_dir() -> Path:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build_k8s.py"), "--where"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _keys(work: Path) -> None:
    """The service-account signing key pair (the API server signs tokens, verifies them)."""
    for cmd in (
        ["openssl", "genrsa", "-out", "sa.key", "2048"],
        ["openssl", "rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"],
    ):
        subprocess.run(cmd, cwd=work, check=True, capture_output=True)


class ControlPlane:
    def __init__(self, work: Path, bin_dir: Path) -> None:
        self.work, self.bin = work, bin_dir
        base = worker_port_base()  # a reserved loopback block (tests/loopback.py)
        self.etcd_port, self.etcd_peer, self.api_port, self.kcm_port = (base + i for i in range(4))
        self.url = f"https://127.0.0.1:{self.api_port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ca = work / "certs" / "apiserver.crt"
        self.version = ""

    # -- processes ---------------------------------------------------------------------
    def _run(
        self, name: str, flags: list[str], health: str, timeout_s: float, admin: bool = False
    ) -> None:
        """Start the component ``name`` (its binary in bin/) with ``flags``, its output in
        ``name``.log, and wait until its ``health`` URL answers."""
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - the process keeps it
        self.procs[name] = subprocess.Popen(
            [str(self.bin / name), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        what = f"{name} {urlsplit(health).path}"
        poll_until(lambda: self.ok(health, admin=admin), timeout_s, what=what)

    def start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer}"
        self._run(
            "etcd",
            [
                "--name=default",
                f"--data-dir={self.work / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            f"http://127.0.0.1:{self.etcd_port}/health",
            60,
        )

    def start_apiserver(self) -> None:
        self._run(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--cert-dir={self.work / 'certs'}",
                f"--token-auth-file={self.work / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={self.work / 'sa.pub'}",
                f"--service-account-signing-key-file={self.work / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=false",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--v=0",
            ],
            self.url + "/readyz",
            120,
            admin=True,
        )
        self.version = self.client().get("/version").json()["gitVersion"]

    def start_controller_manager(self) -> None:
        self._run(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig('kcm', KCM_TOKEN)}",
                "--leader-elect=false",
                f"--controllers={','.join(CONTROLLERS)}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.kcm_port}",
                f"--cert-dir={self.work / 'kcm-certs'}",
                f"--service-account-private-key-file={self.work / 'sa.key'}",
                f"--root-ca-file={self.ca}",
                "--concurrent-gc-syncs=5",
                "--profiling=false",
            ],
            f"https://127.0.0.1:{self.kcm_port}/healthz",
            60,
        )

    def start(self) -> ControlPlane:
        self.work.mkdir(parents=True, exist_ok=True)
        _keys(self.work)
        (self.work / "tokens.csv").write_text(
            f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n'
            f'{KCM_TOKEN},system:kube-controller-manager,kcm-uid,"system:masters"\n'
        )
        self.start_etcd()
        self.start_apiserver()
        self.start_controller_manager()
        return self

    def restart(self, name: str) -> None:
        """Stop one component (SIGTERM, as a rollout would) and start it again."""
        end_group(self.procs.pop(name), grace_s=20)
        {
            "etcd": self.start_etcd,
            "kube-apiserver": self.start_apiserver,
            "kube-controller-manager": self.start_controller_manager,
        }[name]()

    def stop(self, kill: bool = False) -> None:
        """SIGTERM each component and wait up to 20 s for it; with ``kill``, SIGKILL: the end
        of a run, when nothing reads its state again (the tier's last test, whose teardown
        stops the plane, recorded 23 s quiet and 46 s in CI)."""
        sig = signal.SIGKILL if kill else signal.SIGTERM
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            proc = self.procs.pop(name, None)
            if proc is not None:
                end_group(proc, sig, grace_s=20)

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]

    # -- clients -------------------------------------------------------------------------
    def ok(self, url: str, admin: bool = False) -> bool:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if admin else {}
        try:
            return httpx.get(url, verify=False, headers=headers, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, token: str = ADMIN_TOKEN) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            verify=ssl.create_default_context(cafile=str(self.ca)),
            timeout=30,
            headers={"Authorization": f"Bearer {token}"},
        )

    def kubeconfig(self, name: str, token: str = ADMIN_TOKEN, namespace: str = "default") -> Path:
        path = self.work / f"kubeconfig-{name}"
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: real, cluster: {{server: '{self.url}', "
            f"certificate-authority: '{self.ca}'}}}}]\n"
            f"users: [{{name: {name}, user: {{token: '{token}'}}}}]\n"
            f"contexts: [{{name: {name}, context: {{cluster: real, user: {name}, "
            f"namespace: {namespace}}}}}]\n"
            f"current-context: {name}\n"
        )
        return path

    def logs(self, name: str, tail: int = 4000) -> str:
        return (self.work / f"{name}.log").read_text(errors="replace")[-tail:]


def find_binaries() -> Path | None:
    """The folder with etcd, kube-apiserver and kube-controller-manager, or None."""
    found = assets_dir()
    need = ("etcd", "kube-apiserver", "kube-controller-manager")
    return found if all((found / b).is_file() for b in need) else None
