"""Deployment manifests: router, prefill pool, decode pool."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.operator import kv_tiers
from pdserve.operator import naming as n
from pdserve.operator import pod_template as pt
from pdserve.operator import render_pods as p
from pdserve.operator.adapters import adapter_mounts, adapter_volumes
from pdserve.operator.spec import LLMServiceSpec, PoolSpec


def _scrape(role: str) -> dict[str, str]:
    # The router's /metrics needs an admin key on its HTTP port once API keys are on;
    # its admin port opens it without one (kept off the Ingress: render.py).
    port = n.ADMIN_PORT if role == "router" else n.HTTP_PORT
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


_PROGRESS_DEADLINE_S = 3600
# Draining on termination: the preStop pause lets the EndpointSlice (and so the router's
# discovery) drop the pod before SIGTERM; then the server stops accepting and lets its
# streams finish. Router and decode carry whole generations, so their grace period is
# sized for long ones; prefill requests end with the first token.
PRESTOP_PAUSE_S = 10
GRACE_PERIOD_S = {"router": 600, "prefill": 120, "decode": 600}
_ROUTER_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}


def _env(spec: LLMServiceSpec, role: str) -> list[dict[str, Any]]:
    field = {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    env: list[dict[str, Any]] = [
        {"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in field.items()
    ]
    # Workers accept requests and KV reads only from holders of the service's shared secret;
    # while it rotates, the Secret's "accepted" entry is taken too (pdserve/keys.py); the
    # prefix cache's hash key is its own entry, which never rotates (protocol/hashing.py).
    name = n.service_secret_name(spec.name)
    for var, key, optional in (
        ("PDSERVE_SERVICE_SECRET", n.SECRET_KEY, False),
        ("PDSERVE_SERVICE_SECRET_ACCEPTED", n.SECRET_ACCEPTED_KEY, True),
        ("PDSERVE_BLOCK_HASH_KEY", n.HASH_KEY_KEY, True),
    ):
        ref: dict[str, Any] = {"name": name, "key": key}
        if optional:
            ref["optional"] = True
        env.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    # The root filesystem is read-only: caches go to the /tmp emptyDir.
    env += [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"}]
    if _shares_compiled_code(spec, role):
        env += [
            {"name": "PDSERVE_COMPILE_CACHE", "value": f"{n.COMPILE_CACHE_MOUNT}/inductor"},
            {"name": "PDSERVE_KERNEL_CACHE", "value": f"{n.COMPILE_CACHE_MOUNT}/kernels"},
        ]
    elif _reads_model_seal(spec, role):  # where the workers' model seal is (model_seal.py)
        env += [{"name": "PDSERVE_COMPILE_CACHE", "value": f"{n.COMPILE_CACHE_MOUNT}/inductor"}]
    return env


def _shares_compiled_code(spec: LLMServiceSpec, role: str) -> bool:
    """Workers keep compiled code in the shared model cache, where there is one."""
    return role in n.POOL_ROLES and bool(spec.model.source.cache_claim)


def _reads_model_seal(spec: LLMServiceSpec, role: str) -> bool:
    """The router loads the tokenizer from the shared cache only as the workers sealed it
    (engine/model_seal.py): it reads their compiled-code folder, never writes it."""
    return role == "router" and bool(spec.model.source.cache_claim)


def _ports(role: str) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": n.HTTP_PORT, "protocol": "TCP"}]
    if role in n.POOL_ROLES:
        ports.append(
            {"name": "side-channel", "containerPort": n.SIDE_CHANNEL_PORT, "protocol": "TCP"}
        )
    if role == "prefill":
        ports.append({"name": "kv-events", "containerPort": n.KV_EVENTS_PORT, "protocol": "TCP"})
    if role == "router":
        ports.append({"name": "admin", "containerPort": n.ADMIN_PORT, "protocol": "TCP"})
    return ports


def pool_resources(spec: LLMServiceSpec, pool: PoolSpec) -> dict[str, Any]:
    """Requests/limits of a worker: the user's, plus the RDMA device when configured.

    Extended resources (``nvidia.com/gpu``, RDMA) must be equal in requests and limits.
    """
    requests = dict(pool.resources.get("requests") or {})
    limits = dict(pool.resources.get("limits") or {})
    rdma = spec.kv_transfer.rdma_resource_name
    if rdma:
        count = spec.kv_transfer.rdma_resource_count
        requests[rdma] = count
        limits[rdma] = count
    for key, value in limits.items():
        if "/" in key and key not in requests:
            requests[key] = value
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(spec: LLMServiceSpec, role: str, shm_size: str) -> list[dict[str, Any]]:
    vols = [p.model_volume(spec), {"name": "tmp", "emptyDir": {}}]
    if role in n.POOL_ROLES:
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}})
    if role == "router" and spec.router.api_key_secret:
        secret = {"secretName": spec.router.api_key_secret, "defaultMode": 0o440}
        vols.append({"name": "api-key", "secret": secret})
    return vols + adapter_volumes(spec)  # LoRA adapters: every worker and the router


def _mounts(spec: LLMServiceSpec, role: str) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {
            "name": "model",
            "mountPath": n.MODEL_MOUNT,
            # Only an emptyDir download is written by the pod itself (its init container);
            # a shared cache is filled by init containers and read by everyone.
            "readOnly": spec.model.source.kind != "huggingFace"
            or bool(spec.model.source.cache_claim),
        },
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if _shares_compiled_code(spec, role) or _reads_model_seal(spec, role):
        # the one part of the shared cache workers write (the router: read-only)
        folder = {
            "name": "model",
            "mountPath": n.COMPILE_CACHE_MOUNT,
            "subPath": n.compile_cache_subpath(spec.name),
        }
        mounts.append(folder | ({"readOnly": True} if role == "router" else {}))
    if role in n.POOL_ROLES:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if role == "router" and spec.router.api_key_secret:
        mounts.append({"name": "api-key", "mountPath": "/etc/pdserve/api-key", "readOnly": True})
    return mounts + adapter_mounts(spec)


def _container(
    spec: LLMServiceSpec,
    role: str,
    command: list[str],
    resources: Mapping[str, Any],
    extra_env: tuple[Mapping[str, Any], ...],
) -> dict[str, Any]:
    needs_ipc_lock = role in n.POOL_ROLES and spec.kv_transfer.ipc_lock
    return {
        "name": role,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": command,
        "ports": _ports(role),
        "env": _env(spec, role) + [dict(e) for e in extra_env],
        "envFrom": [{"configMapRef": {"name": n.config_map_name(spec.name)}}],
        "resources": _with_ephemeral_storage(resources, p.ephemeral_storage_request(spec, role)),
        "volumeMounts": _mounts(spec, role),
        "securityContext": p.container_security(spec, needs_ipc_lock),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_PAUSE_S)]}}},
        **p.probes(),
    }


def _with_ephemeral_storage(resources: Mapping[str, Any], request: str) -> dict[str, Any]:
    out = {k: dict(v) for k, v in resources.items()}
    out.setdefault("requests", {}).setdefault("ephemeral-storage", request)  # the user's wins
    return out


def _pod_spec(
    spec: LLMServiceSpec, role: str, container: dict[str, Any], shm_size: str
) -> dict[str, Any]:
    is_router = role == "router"
    pod: dict[str, Any] = {
        "automountServiceAccountToken": is_router,  # only the router talks to the API
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": _volumes(spec, role, shm_size),
        "terminationGracePeriodSeconds": GRACE_PERIOD_S[role],
    }
    init = p.download_init_container(spec, tokenizer_only=is_router)
    if _shares_compiled_code(spec, role) or _reads_model_seal(spec, role):
        init += p.compile_cache_init_container(spec)  # the folder, as the pod's user
    if init:  # the API server drops empty lists; keep live and desired comparable
        pod["initContainers"] = init
    if is_router:
        pod["serviceAccountName"] = n.router_account_name(spec.name)
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    return pod


def _deployment(
    spec: LLMServiceSpec,
    role: str,
    replicas: int,
    pod: dict[str, Any],
    config_hash: str,
    override: Mapping[str, Any],
) -> dict[str, Any]:
    annotations = {**_scrape(role), n.ANNOTATION_CONFIG_HASH: config_hash}
    # Surge first, everywhere: a new pod must be ready before an old one goes, or a
    # 1-replica pool has an outage per rollout. Without a spare GPU the rollout waits
    # (Progressing) instead of taking capacity away.
    rolling = {"maxSurge": 1, "maxUnavailable": 0}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": n.deployment_name(spec.name, role),
            "namespace": spec.namespace,
            "labels": n.labels(spec.name, role),
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": n.selector(spec.name, role)},
            # A model load may take the startup probe's 30 minutes: only past that (plus an
            # image pull and a download) is a rollout stuck, and the service Degraded.
            "progressDeadlineSeconds": _PROGRESS_DEADLINE_S,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
            "template": pt.apply(
                {
                    "metadata": {"labels": n.labels(spec.name, role), "annotations": annotations},
                    "spec": pod,
                },
                override,
            ),
        },
    }


def pool_deployment(spec: LLMServiceSpec, pool: PoolSpec, config_hash: str) -> dict[str, Any]:
    container = _container(
        spec, pool.role, p.worker_command(spec, pool), pool_resources(spec, pool), pool.env
    )
    pod = _pod_spec(spec, pool.role, container, pool.shm_size)
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [dict(t) for t in pool.tolerations]
    if pool.affinity:
        pod["affinity"] = dict(pool.affinity)
    kv_tiers.add_to_pod(spec, pool.role, pod)
    return _deployment(spec, pool.role, pool.replicas, pod, config_hash, pool.pod_template)


def router_deployment(spec: LLMServiceSpec, config_hash: str) -> dict[str, Any]:
    r = spec.router
    resources = r.resources or _ROUTER_RESOURCES
    # --budget-peers kubernetes: the replica's own address among its Service's endpoints
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    container = _container(spec, "router", p.router_command(spec), resources, (pod_ip,))
    pod = _pod_spec(spec, "router", container, "")
    if r.node_selector:
        pod["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod["tolerations"] = [dict(t) for t in r.tolerations]
    return _deployment(spec, "router", r.replicas, pod, config_hash, r.pod_template)
