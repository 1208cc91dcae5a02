"""Deployments for the router and the two worker pools (pure functions of the spec).

Command lines follow docs/architecture.md; every container listens on 8080
(HTTP), 8081 (KV events) and 8082 (side channel); the router also on 8083 (admin).
"""

from __future__ import annotations

import posixpath
from typing import Any

from pdserve.operator import kv_tiers
from pdserve.operator import naming as n
from pdserve.operator.adapters import lora_args
from pdserve.operator.spec import LLMServiceSpec, PoolSpec, RouterSpec
from pdserve.router.config import PREFILL_SCORERS

# The CRD's router.routing → the router's --picker.
PICKER_OF_ROUTING = {"prefix": "max-score", "round-robin": "round-robin"}

_TOKENIZER_FILES = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
_API_KEY_DIR = "/etc/pdserve/api-key"
_UID = 1000


def model_dir(spec: LLMServiceSpec) -> str:
    src = spec.model.source
    if src.kind == "pvc":
        return posixpath.normpath(posixpath.join(n.MODEL_MOUNT, src.path.lstrip("/")))
    if src.kind == "hostPath":
        return n.MODEL_MOUNT
    if src.cache_claim:  # one directory per model and revision in the shared cache
        rev = f"@{src.revision}" if src.revision else ""
        return f"{n.MODEL_MOUNT}/{src.hf_id.replace('/', '--')}{rev}"
    return f"{n.MODEL_MOUNT}/model"


def model_volume(spec: LLMServiceSpec) -> dict[str, Any]:
    src = spec.model.source
    if src.kind == "pvc":
        return {
            "name": "model",
            "persistentVolumeClaim": {"claimName": src.claim_name, "readOnly": True},
        }
    if src.kind == "hostPath":
        return {"name": "model", "hostPath": {"path": src.path, "type": "Directory"}}
    if src.cache_claim:  # the init container fills it once; later pods find the files there
        return {"name": "model", "persistentVolumeClaim": {"claimName": src.cache_claim}}
    return {"name": "model", "emptyDir": {"sizeLimit": src.download_size_limit}}


def ephemeral_storage_request(spec: LLMServiceSpec, role: str) -> str:
    """What a pod writes to node-local disk: the model download (emptyDir) or nothing big.

    Without a request the scheduler places a 16 GB download on a node with 2 GB free and
    the kubelet evicts the pod; the router fetches only tokenizer files."""
    src = spec.model.source
    if src.kind != "huggingFace" or src.cache_claim:
        return "1Gi"
    return "1Gi" if role == "router" else src.download_size_limit


def download_init_container(spec: LLMServiceSpec, tokenizer_only: bool) -> list[dict[str, Any]]:
    """Init container fetching a Hugging Face model into the emptyDir (router: no weights)."""
    src = spec.model.source
    if src.kind != "huggingFace":
        return []
    cmd = ["hf", "download", src.hf_id, "--local-dir", model_dir(spec)]
    if src.revision:
        cmd += ["--revision", src.revision]
    if tokenizer_only:
        cmd += ["--include", *_TOKENIZER_FILES]
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": f"{n.MODEL_MOUNT}/.cache"}]
    if src.token_secret:
        ref = {"name": src.token_secret, "key": src.token_key}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return [
        {
            "name": "download-model",
            "image": spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": cmd,
            "env": env,
            "volumeMounts": [{"name": "model", "mountPath": n.MODEL_MOUNT}, _tmp_mount()],
            "securityContext": container_security(spec, False),
            "resources": {
                "requests": {"cpu": "500m", "memory": "1Gi"},
                "limits": {"memory": "4Gi"},
            },
        }
    ]


def compile_cache_init_container(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    """Creates the workers' compiled-code folder in the shared cache as the pod's user
    (a folder the kubelet made for the subPath mount could belong to root)."""
    if not spec.model.source.cache_claim:
        return []
    folder = f"{n.MODEL_MOUNT}/{n.compile_cache_subpath(spec.name)}"
    return [
        {
            "name": "compile-cache-dir",
            "image": spec.image,
            "imagePullPolicy": spec.image_pull_policy,
            "command": ["mkdir", "-p", folder],
            "volumeMounts": [{"name": "model", "mountPath": n.MODEL_MOUNT}],
            "securityContext": container_security(spec, False),
            "resources": {
                "requests": {"cpu": "10m", "memory": "16Mi"},
                "limits": {"memory": "64Mi"},
            },
        }
    ]


def engine_args(spec: LLMServiceSpec, pool: PoolSpec) -> list[str]:
    m = spec.model
    args = ["--dtype", m.dtype, "--device", "auto", "--block-size", str(m.block_size)]
    args += ["--served-model-name", m.served_name]
    if pool.kv_cache_bytes is not None:
        args += ["--kv-cache-bytes", str(pool.kv_cache_bytes)]
    if pool.kv_cache_fraction is not None:
        args += ["--kv-cache-fraction", str(pool.kv_cache_fraction)]
    if m.max_model_len is not None:
        args += ["--max-model-len", str(m.max_model_len)]
    if pool.max_num_seqs is not None:
        args += ["--max-num-seqs", str(pool.max_num_seqs)]
    if pool.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(pool.max_num_batched_tokens)]
    if pool.speculative:
        args += ["--speculative", pool.speculative]
    return args


def worker_command(spec: LLMServiceSpec, pool: PoolSpec) -> list[str]:
    kv = spec.kv_transfer
    cmd = ["pdserve", f"{pool.role}-worker", "--model", model_dir(spec), "--host", "0.0.0.0"]
    cmd += ["--port", str(n.HTTP_PORT), "--side-channel-port", str(n.SIDE_CHANNEL_PORT)]
    cmd += ["--worker-id", "$(POD_NAME)", "--kv-transport", kv.transport]
    if pool.role == "prefill":
        cmd += ["--kv-events-port", str(n.KV_EVENTS_PORT), "--lease-seconds", str(kv.lease_seconds)]
    else:
        cmd += ["--transfer-timeout", str(kv.transfer_timeout_seconds)]
        cmd += ["--on-transfer-failure", kv.on_transfer_failure]
    tiers = kv_tiers.worker_args(spec, pool.role)
    return cmd + engine_args(spec, pool) + lora_args(spec) + tiers + list(pool.extra_args)


def router_command(spec: LLMServiceSpec) -> list[str]:
    r = spec.router
    cmd = ["pdserve", "router", "--model", model_dir(spec)]
    cmd += ["--served-model-name", spec.model.served_name, "--host", "0.0.0.0"]
    cmd += ["--port", str(n.HTTP_PORT), "--admin-port", str(n.ADMIN_PORT)]
    cmd += ["--discovery", "kubernetes"]
    cmd += ["--service", spec.name, "--namespace", spec.namespace]
    cmd += ["--picker", PICKER_OF_ROUTING[r.routing], *scorer_args(r)]
    cmd += ["--procs", "auto"]  # one router process per CPU of the container's limit
    cmd += ["--pd-handoff", r.pd_handoff]
    if r.api_key_secret:
        cmd += ["--api-key-file", f"{_API_KEY_DIR}/{r.api_key_key}"]
    optional = {
        "--disagg-threshold": r.disagg_threshold,
        "--max-queue": r.max_queue,
    }
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + limit_args(r) + lora_args(spec) + list(r.extra_args)


def limit_args(r: RouterSpec) -> list[str]:
    """``spec.router.limits``: per key, for the whole service, rendered as given and kept
    exact across the router replicas: ``--budget-peers kubernetes`` (router/peer_budgets.py)
    makes one replica, found among the ready endpoints of the router's own Service, keep
    each key's counters; the others ask it on ``--admin-port`` (the NetworkPolicy opens
    that port to the service's router pods, operator/render_netpol.py; ``POD_IP`` from the
    downward API names the replica itself)."""
    given = {
        "--rate-limit-rpm": r.limits.requests_per_minute,
        "--rate-limit-tpm": r.limits.tokens_per_minute,
        "--max-concurrency-per-key": r.limits.max_concurrency_per_key,
    }
    out = [arg for flag, value in given.items() if value for arg in (flag, str(value))]
    return [*out, "--budget-peers", "kubernetes"] if out else []


def scorer_args(r: RouterSpec) -> list[str]:
    """``prefixWeight`` / ``loadWeight`` over the router's default prefill scorers."""
    given = {"prefix": r.prefix_weight, "load": r.load_weight}
    if all(w is None for w in given.values()):
        return []
    pairs = dict(PREFILL_SCORERS) | {n: w for n, w in given.items() if w is not None}
    return [arg for n, w in pairs.items() for arg in ("--scorer", f"{n}={w:g}")]


def container_security(spec: LLMServiceSpec, needs_ipc_lock: bool) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if needs_ipc_lock:  # RDMA memory registration pins pages
        caps["add"] = ["IPC_LOCK"]
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": caps,
    }


def _tmp_mount() -> dict[str, Any]:
    return {"name": "tmp", "mountPath": "/tmp"}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def probes() -> dict[str, Any]:
    # Readiness (/health) = can serve: 503 until the model is loaded, and on the router while
    # no decode worker is ready. Liveness (/livez) = the process answers: a decode rollout
    # must never restart the router (losing its prefix index). The startup probe allows
    # 30 minutes for a large model to load before liveness starts counting. Both paths stay
    # open with API keys on (router/app.py), so the probes keep the public port.
    return {
        "startupProbe": _probe("/livez", 10, 180),
        "readinessProbe": _probe("/health", 5, 3),
        "livenessProbe": _probe("/livez", 10, 6),
    }
