"""The LLMService spec as frozen dataclasses.

The CRD (``charts/pdserve/crds/``) validates and defaults the spec on the API
server; ``parse_spec`` applies the same defaults here so that ``pdserve render``
works on a file that never went through the API server (a test keeps the two
sets of defaults equal). Bad input raises ``SpecError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.operator.kv_tiers import KVTiersSpec
from pdserve.transfer.registry import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_TRANSFER_TIMEOUT,
    DEFAULT_TRANSPORT,
    TRANSPORT_NAMES,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The kv transports the CRD accepts: the registry's keys (a test checks the CRD's enum).
TRANSPORTS = TRANSPORT_NAMES
SERVICE_TYPES = ("ClusterIP", "LoadBalancer", "NodePort")


class SpecError(ValueError):
    """An LLMService spec that cannot be rendered; ``field`` is a dotted path like spec.model."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path
        self.message = message


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "pvc" | "hostPath" | "huggingFace"
    claim_name: str = ""
    path: str = ""
    hf_id: str = ""
    revision: str = ""
    token_secret: str = ""
    token_key: str = "token"
    download_size_limit: str = "64Gi"
    cache_claim: str = ""  # a ReadWriteMany PVC shared by every pod: one download, not one per pod


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    served_name: str
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16


@dataclass(frozen=True)
class PoolSpec:
    role: str  # "prefill" | "decode"
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 4
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    shm_size: str = "2Gi"
    pod_template: Mapping[str, Any] = field(default_factory=dict)  # merged over the pod
    # An HPA / KEDA scales this pool's Deployment: the operator keeps its replica count.
    external_scaling: bool = False
    speculative: str = ""  # decode only: --speculative, e.g. "ngram:k=4" (docs/speculative.md)

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class IngressSpec:
    host: str
    class_name: str = ""
    annotations: Mapping[str, str] = field(default_factory=dict)
    tls_secret_name: str = ""


@dataclass(frozen=True)
class RouterLimits:
    """``spec.router.limits``: per API key for the whole service; 0 is no limit."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrency_per_key: int = 64  # a safe default: one key cannot take every slot


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    service_type: str = "ClusterIP"
    ingress: IngressSpec | None = None
    api_key_secret: str = ""
    api_key_key: str = "api-key"
    routing: str = "prefix"
    prefix_weight: float | None = None
    load_weight: float | None = None
    disagg_threshold: int | None = None
    # who calls the prefill worker on the P/D path: "router" or "decode" (--pd-handoff)
    pd_handoff: str = "router"
    max_queue: int | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    extra_args: tuple[str, ...] = ()
    pod_template: Mapping[str, Any] = field(default_factory=dict)  # merged over the pod
    # Gateway API: parentRefs (Gateways) and hostnames of an HTTPRoute to the router.
    http_route_parents: tuple[Mapping[str, Any], ...] = ()
    http_route_hostnames: tuple[str, ...] = ()
    # "router" (built-in) | "endpointPicker": the router as a Gateway API Inference Extension
    # endpoint picker behind an InferencePool (operator/render_picker.py)
    mode: str = "router"
    limits: RouterLimits = field(default_factory=RouterLimits)
    # endpointPicker: the Secret with the gateway's ext_proc credential (--gateway-token-file)
    gateway_token_secret: str = ""
    gateway_token_key: str = "token"
    # endpointPicker: a kubernetes.io/tls Secret with ca.crt: ext_proc over mutual TLS
    ext_proc_tls_secret: str = ""


@dataclass(frozen=True)
class SLOSpec:
    ttft_ms: int = 1000
    tpot_ms: int = 100
    target_attainment: float = 0.9


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    interval_seconds: int = 30
    scale_up_stabilization_seconds: int = 60
    scale_down_stabilization_seconds: int = 300
    metrics_url: str = ""


@dataclass(frozen=True)
class KVTransferSpec:
    transport: str = DEFAULT_TRANSPORT
    ucx_tls: str = ""
    ucx_net_devices: str = ""
    # UCX over TCP listens on ephemeral ports unless pinned: pinned, the NetworkPolicy can
    # open exactly these (a default-deny CNI would otherwise time out every KV read).
    ucx_tcp_port_start: int = 20000
    ucx_tcp_port_end: int = 20031
    rdma_resource_name: str = ""
    rdma_resource_count: int = 1
    # IPC_LOCK lets RDMA pin registered memory; PodSecurity "restricted" refuses it, so it
    # is an explicit opt-in rather than implied by an RDMA resource.
    ipc_lock: bool = False
    lease_seconds: int = int(DEFAULT_LEASE_SECONDS)
    transfer_timeout_seconds: int = int(DEFAULT_TRANSFER_TIMEOUT)
    on_transfer_failure: str = "recompute"


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool = True
    metrics_namespaces: tuple[str, ...] = ()
    gateway_namespaces: tuple[str, ...] = ()  # endpointPicker: who reaches the gRPC port


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter (operator/adapters.py): every worker and the router mount its volume
    read-only at /adapters/<name> and serve it as model <name> (``--lora``)."""

    name: str
    kind: str  # "pvc" | "image" (a Kubernetes image volume: an OCI artifact or image)
    claim_name: str = ""
    reference: str = ""
    path: str = ""  # the adapter's directory inside the volume ("": its root)
    pull_policy: str = "IfNotPresent"


@dataclass(frozen=True)
class LLMServiceSpec:
    name: str
    namespace: str
    model: ModelSpec
    prefill: PoolSpec
    decode: PoolSpec
    router: RouterSpec = RouterSpec()
    slo: SLOSpec = SLOSpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    kv_transfer: KVTransferSpec = KVTransferSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    image: str = ""  # "": the operator's default image (render.DEFAULT_IMAGE or --default-image)
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    adapters: tuple[AdapterSpec, ...] = ()  # LoRA adapters served beside the base model
    kv_tiers: KVTiersSpec = field(
        default_factory=KVTiersSpec
    )  # spec.kvCache.tiers (operator/kv_tiers.py)

    @property
    def pools(self) -> tuple[PoolSpec, PoolSpec]:
        return (self.prefill, self.decode)
