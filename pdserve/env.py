"""Every ``PDSERVE_*`` environment variable, read in one place.

Each is read when asked for (not at import), so tests and ``pdserve up`` can set them per
process. Kubernetes-provided variables (``POD_IP``, ``KUBERNETES_SERVICE_*``) are read
where they are used; they are not ours.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

SERVICE_SECRET = "PDSERVE_SERVICE_SECRET"  # router ↔ workers and the KV side channel
SERVICE_SECRET_ACCEPTED = "PDSERVE_SERVICE_SECRET_ACCEPTED"  # also accepted, never signs: rotation
SECRET_HEADER = "X-PDServe-Secret"  # the bearer header of old: workers refuse it (signing.py)
BLOCK_HASH_KEY = "PDSERVE_BLOCK_HASH_KEY"  # the prefix cache's hash key (else from the secret)
API_KEY = "PDSERVE_API_KEY"  # the router's client-facing key
ADMIN_API_KEY = "PDSERVE_ADMIN_API_KEY"  # the router's key for /metrics and /workers
ADVERTISE_HOST = "PDSERVE_ADVERTISE_HOST"  # the address peers use to reach a worker
CACHE = "PDSERVE_CACHE"  # where `pdserve up` keeps downloaded models
SERVICE = "PDSERVE_SERVICE"  # the LLMService name (set by the operator)
KV_TRANSPORT = "PDSERVE_KV_TRANSPORT"  # set by the operator, for logs and tools
KERNEL_CACHE = "PDSERVE_KERNEL_CACHE"  # where the CPU attention kernel is compiled to
CPU_KERNEL = "PDSERVE_CPU_KERNEL"  # "0": never build or use the CPU attention kernel
ATTENTION_BACKEND = "PDSERVE_ATTENTION_BACKEND"  # cpu, triton or gather; unset: by device
CPU_LINEAR = "PDSERVE_CPU_LINEAR"  # compiled CPU linears: auto, blas or onednn
ENFORCE_EAGER = "PDSERVE_ENFORCE_EAGER"  # "1": workers skip torch.compile (--enforce-eager)
GRAPH_CALLS = "PDSERVE_GRAPH_CALLS"  # "0": compiled graphs only through torch.compile's wrapper
COMPILE_CACHE = "PDSERVE_COMPILE_CACHE"  # where inductor keeps compiled graphs
CORE_ZYGOTE = "PDSERVE_CORE_ZYGOTE"  # a core zygote's socket (worker/core/zygote.py)
PARENT_PID = "PDSERVE_PARENT_PID"  # end with this parent (local/parent_watch.py)
OPERATOR_STATUS_INTERVAL = "PDSERVE_OPERATOR_STATUS_INTERVAL"
OPERATOR_RETRY_DELAY = "PDSERVE_OPERATOR_RETRY_DELAY"
OPERATOR_AUTOSCALE_TICK = "PDSERVE_OPERATOR_AUTOSCALE_TICK"
OPERATOR_ROUTER_METRICS_URL = "PDSERVE_OPERATOR_ROUTER_METRICS_URL"
OPERATOR_MODEL_HOST_PATHS = "PDSERVE_OPERATOR_MODEL_HOST_PATHS"  # kopf_entry: pod policy
OPERATOR_ALLOW_UNSAFE_POD_FIELDS = "PDSERVE_OPERATOR_ALLOW_UNSAFE_POD_FIELDS"
OPERATOR_METRICS_URL_ALLOW = "PDSERVE_OPERATOR_METRICS_URL_ALLOW"  # CIDRs, comma-separated
OPERATOR_NAMESPACE = "PDSERVE_OPERATOR_NAMESPACE"  # the operator's own (router NetworkPolicy)
DEFAULT_IMAGE = "PDSERVE_DEFAULT_IMAGE"  # the operator's image for pods that name none
KV_SHARED_PASSWORD = "PDSERVE_KV_SHARED_PASSWORD"  # the shared KV tier's password (a Secret)
PROMETHEUS_BIN = "PDSERVE_PROMETHEUS_BIN"  # tests: the prometheus binary (else on PATH)
REQUIRE_PROMETHEUS = "PDSERVE_REQUIRE_PROMETHEUS"  # tests: a missing prometheus fails, not skips
REQUIRE_LANE = "PDSERVE_REQUIRE_LANE"  # tests: a lane not built (or stale) fails, not skips
TEST_TRANSPORT = "PDSERVE_TEST_TRANSPORT"  # tests: the suite's pdserve up KV transport (nixl)

_warned: set[str] = set()


def get(name: str, default: str = "") -> str:
    return os.environ.get(name) or default


def get_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


def eager_forced() -> bool:
    """``PDSERVE_ENFORCE_EAGER`` set (and not "0"): workers skip torch.compile."""
    return get(ENFORCE_EAGER) not in ("", "0")


def service_secret(role: str = "") -> str:
    """The service's shared secret; "" (and one warning per process) when unset."""
    secret = os.environ.get(SERVICE_SECRET, "")
    if not secret and SERVICE_SECRET not in _warned:
        _warned.add(SERVICE_SECRET)
        log.warning(
            "%s is not set: %s accepts unauthenticated internal requests and KV peers",
            SERVICE_SECRET,
            role or "this process",
        )
    return secret


def cache_dir() -> Path:
    return Path(get(CACHE) or Path.home() / ".cache" / "pdserve")
