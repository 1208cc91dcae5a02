"""Names, labels and ports shared by rendering, reconciliation and status.

Label keys and container ports are contracts (docs/architecture.md): the router
discovers workers by ``pdserve.io/service`` + ``pdserve.io/role``.
"""

from __future__ import annotations

GROUP = "pdserve.io"
VERSION = "v1alpha1"
PLURAL = "llmservices"
KIND = "LLMService"
API_VERSION = f"{GROUP}/{VERSION}"

ROLES = ("router", "prefill", "decode")
POOL_ROLES = ("prefill", "decode")

HTTP_PORT = 8080  # every container: HTTP (API, /health, /metrics)
KV_EVENTS_PORT = 8081  # prefill: ZeroMQ PUB of KV events
SIDE_CHANNEL_PORT = 8082  # both workers: NIXL handshake / lease release
ROUTER_SERVICE_PORT = 80
# Router only: --admin-port, where /metrics and /workers need no key (router/runtime.py).
# Only the internal admin Service reaches it, never the Ingress/HTTPRoute, so the scrapes
# (the operator's autoscaler, Prometheus) keep working once tenant API keys are on.
ADMIN_PORT = 8083
# What the Ingress and the HTTPRoute expose: the OpenAI API a tenant calls, and nothing
# else of /v1 (not /v1/load_lora_adapter and /v1/unload_lora_adapter, the admin's).
PUBLIC_API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/responses")

MODEL_MOUNT = "/models"
# Workers' compiled code (inductor graphs, the attention kernel) in the shared model cache:
# a new pod loads what another compiled instead of compiling for minutes. Keyed by CPU
# inside (engine/host_tag.py), so nodes of different CPUs share the volume safely.
COMPILE_CACHE_MOUNT = "/var/cache/pdserve"
COMPILE_CACHE_SUBPATH = ".pdserve-compiled"


def compile_cache_subpath(name: str) -> str:
    """Each service's own folder of the shared cache: services that share a model cache
    never load each other's code (and what is inside is sealed: engine/cache_seal.py)."""
    return f"{COMPILE_CACHE_SUBPATH}/{name}"


LABEL_SERVICE = "pdserve.io/service"
LABEL_ROLE = "pdserve.io/role"
ANNOTATION_LAST_APPLIED = "pdserve.io/last-applied"
ANNOTATION_CONFIG_HASH = "pdserve.io/config-hash"
MANAGED_BY = "pdserve-operator"


def labels(name: str, role: str | None = None) -> dict[str, str]:
    out = {
        LABEL_SERVICE: name,
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if role is not None:
        out[LABEL_ROLE] = role
        out["app.kubernetes.io/component"] = role
    return out


def selector(name: str, role: str) -> dict[str, str]:
    """Pod selector of a Deployment / Service (immutable on Deployments: keep it minimal)."""
    return {LABEL_SERVICE: name, LABEL_ROLE: role}


# Every child is named ``<name>`` or ``<name>-<suffix>``. An LLMService may not itself end
# in ``-<suffix>`` (the CRD and the parser refuse it): then ``chat`` and ``chat-prefill``
# can never render the same child name, and the two reconcilers cannot fight over it.
RESERVED_SUFFIXES = ("router", "prefill", "decode", "config", "workers", "secret")
SECRET_KEY = "secret"  # the key of the per-service Secret (env PDSERVE_SERVICE_SECRET)
SECRET_ACCEPTED_KEY = "accepted"  # set by hand while rotating (docs/security.md)
HASH_KEY_KEY = "hash-key"  # the prefix cache's block-hash key: created once, never rotated


def reserved_suffix(name: str) -> str:
    return next((s for s in RESERVED_SUFFIXES if name.endswith(f"-{s}")), "")


def service_secret_name(name: str) -> str:
    return f"{name}-secret"


def network_policy_name(name: str) -> str:
    return f"{name}-workers"


def deployment_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def router_service_name(name: str) -> str:
    return name


def router_admin_service_name(name: str) -> str:
    return f"{name}-router-admin"


def pool_service_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def router_account_name(name: str) -> str:
    return f"{name}-router"


def config_map_name(name: str) -> str:
    return f"{name}-config"


def endpoint_url(name: str, namespace: str, ingress_host: str = "", tls: bool = False) -> str:
    """Where clients reach the OpenAI API (the ``/v1`` base URL)."""
    if ingress_host:
        return f"{'https' if tls else 'http'}://{ingress_host}/v1"
    return f"http://{router_service_name(name)}.{namespace}.svc/v1"
