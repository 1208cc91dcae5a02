"""How the router reaches the Kubernetes API: base URL, bearer token, TLS.

In a pod: ``KUBERNETES_SERVICE_HOST``/``PORT``, the service account's CA and token. The
token is read again for every request (with a short cache): bound service-account tokens
expire within the hour and the kubelet rewrites the file, so a token read once at start-up
would stop working. Outside a cluster: the current kubeconfig context, through the
official ``kubernetes`` client's loader (token or client-certificate users).
"""

from __future__ import annotations

import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
USER_AGENT = "pdserve-router"
TOKEN_TTL_S = 60.0


@dataclass
class ApiAccess:
    base_url: str
    token: str = ""
    token_file: str = ""  # re-read every TOKEN_TTL_S (in-cluster)
    ssl_context: ssl.SSLContext | bool = True  # False: do not verify (kubeconfig says so)
    _read_at: float = field(default=0.0, repr=False)

    def headers(self) -> dict[str, str]:
        if self.token_file and time.monotonic() - self._read_at > TOKEN_TTL_S:
            self.token = Path(self.token_file).read_text().strip()
            self._read_at = time.monotonic()
        out = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if self.token:
            out["Authorization"] = f"Bearer {self.token}"
        return out


def in_cluster() -> ApiAccess:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # IPv6
        host = f"[{host}]"
    ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
    return ApiAccess(f"https://{host}:{port}", token_file=str(SA_DIR / "token"), ssl_context=ctx)


def from_kubeconfig() -> ApiAccess:
    from kubernetes import client, config

    cfg = client.Configuration()
    # $KUBECONFIG as it is now (the client reads it once, at import)
    config.load_kube_config(os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
    # The client's auth settings (its key name changed between releases): "Bearer <token>".
    auth: Any = cfg.auth_settings().get("BearerToken") or {}
    token = str(auth.get("value") or "").removeprefix("Bearer ").strip()
    ctx: ssl.SSLContext | bool = True
    if cfg.host.startswith("https"):
        if not cfg.verify_ssl:
            ctx = False
        else:
            ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ApiAccess(cfg.host.rstrip("/"), token=token, ssl_context=ctx)


def load_access() -> ApiAccess:
    """In-cluster when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    return from_kubeconfig()
