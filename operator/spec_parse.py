"""Parse an LLMService object (a dict) into ``LLMServiceSpec``, with the CRD's defaults.

Every error names the field (``spec.prefill.maxReplicas: ...``) because the
message ends up in the ``Degraded`` condition and in ``pdserve render`` output.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pdserve.operator import naming as n
from pdserve.operator import pod_template as pt
from pdserve.operator.adapters import parse_adapters
from pdserve.operator.kv_tiers import parse_kv_tiers
from pdserve.operator.spec import (
    DTYPES,
    SERVICE_TYPES,
    TRANSPORTS,
    AutoscalingSpec,
    IngressSpec,
    KVTransferSpec,
    LLMServiceSpec,
    ModelSource,
    ModelSpec,
    NetworkPolicySpec,
    PoolSpec,
    RouterLimits,
    RouterSpec,
    SLOSpec,
    SpecError,
)
from pdserve.operator.spec_checks import (
    check_affinity,
    check_quantity,
    check_resources,
    check_tolerations,
)
from pdserve.operator.url_checks import check_url

_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035: Service names start a-z
_RESOURCE_NAME = re.compile(r"^[a-z0-9.-]+/[a-zA-Z0-9_.-]+$")
_MAX_NAME = 40  # children append "-prefill" etc.; Service names must stay <= 63


class _Reader:
    """Typed access to one mapping of the spec; ``path`` prefixes every error."""

    def __init__(self, data: Any, path: str) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise SpecError(path, f"must be an object, got {type(data).__name__}")
        self.data = data
        self.path = path

    def sub(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), f"{self.path}.{key}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.data.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise SpecError(f"{self.path}.{key}", "must be a number, got a boolean")
        if not isinstance(value, kind):
            name = getattr(kind, "__name__", str(kind))
            raise SpecError(f"{self.path}.{key}", f"must be {name}, got {value!r}")
        return value

    def number(
        self,
        key: str,
        default: Any = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        value = self.get(key, (int, float), default)
        if value is not None and minimum is not None and value < minimum:
            raise SpecError(f"{self.path}.{key}", f"must be >= {minimum}, got {value}")
        if value is not None and maximum is not None and value > maximum:
            raise SpecError(f"{self.path}.{key}", f"must be <= {maximum}, got {value}")
        return value

    def choice(self, key: str, choices: tuple[str, ...], default: str) -> str:
        value = self.get(key, str, default)
        if value not in choices:
            raise SpecError(f"{self.path}.{key}", f"must be one of {list(choices)}, got {value!r}")
        return str(value)

    def str_list(self, key: str) -> tuple[str, ...]:
        items = self.get(key, list, [])
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise SpecError(f"{self.path}.{key}[{i}]", f"must be a string, got {item!r}")
        return tuple(items)

    def obj_list(self, key: str) -> tuple[Mapping[str, Any], ...]:
        items = self.get(key, list, [])
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise SpecError(f"{self.path}.{key}[{i}]", "must be an object")
        return tuple(items)


def parse_model(r: _Reader, default_name: str) -> ModelSpec:
    src = r.sub("source")
    kinds = [k for k in ("pvc", "hostPath", "huggingFace") if src.data.get(k) is not None]
    if len(kinds) != 1:
        raise SpecError(src.path, f"set exactly one of pvc, hostPath, huggingFace (got {kinds})")
    s = src.sub(kinds[0])
    if kinds[0] == "pvc":
        source = ModelSource(
            "pvc", claim_name=s.get("claimName", str, ""), path=s.get("path", str, "")
        )
        if not source.claim_name:
            raise SpecError(f"{s.path}.claimName", "is required")
    elif kinds[0] == "hostPath":
        source = ModelSource("hostPath", path=s.get("path", str, ""))
        if not source.path.startswith("/"):
            raise SpecError(f"{s.path}.path", "must be an absolute path")
    else:
        token = s.sub("tokenSecret")
        source = ModelSource(
            "huggingFace",
            hf_id=s.get("id", str, ""),
            revision=s.get("revision", str, ""),
            token_secret=token.get("name", str, ""),
            token_key=token.get("key", str, "token"),
            download_size_limit=str(s.get("downloadSizeLimit", (str, int), "64Gi")),
            cache_claim=s.sub("cache").get("claimName", str, ""),
        )
        if not source.hf_id:
            raise SpecError(f"{s.path}.id", "is required")
        check_quantity(f"{s.path}.downloadSizeLimit", s.data.get("downloadSizeLimit", "64Gi"))
    return ModelSpec(
        source=source,
        served_name=r.get("servedName", str, default_name),
        dtype=r.choice("dtype", DTYPES, "auto"),
        max_model_len=r.number("maxModelLen", minimum=16),
        block_size=r.number("blockSize", 16, minimum=1),
    )


def parse_pool(r: _Reader, role: str) -> PoolSpec:
    pool = PoolSpec(
        role=role,
        replicas=r.number("replicas", 1, minimum=0),
        min_replicas=r.number("minReplicas", 1, minimum=0),
        max_replicas=r.number("maxReplicas", 4, minimum=1),
        resources=r.get("resources", Mapping, {}),
        node_selector=r.get("nodeSelector", Mapping, {}),
        tolerations=r.obj_list("tolerations"),
        affinity=r.get("affinity", Mapping, {}),
        extra_args=r.str_list("extraArgs"),
        env=r.obj_list("env"),
        kv_cache_bytes=r.number("kvCacheBytes", minimum=1),
        kv_cache_fraction=r.number("kvCacheFraction"),
        max_num_seqs=r.number("maxNumSeqs", minimum=1),
        max_num_batched_tokens=r.number("maxNumBatchedTokens", minimum=1),
        shm_size=str(r.get("shmSize", (str, int), "2Gi")),
        pod_template=r.get("podTemplate", Mapping, {}),
        external_scaling=r.get("externalScaling", bool, False),
        speculative=r.get("speculative", str, ""),
    )
    check_speculative(f"{r.path}.speculative", role, pool.speculative)
    pt.check(f"{r.path}.podTemplate", pool.pod_template)
    check_resources(f"{r.path}.resources", pool.resources)
    check_quantity(f"{r.path}.shmSize", r.data.get("shmSize", "2Gi"))
    check_tolerations(f"{r.path}.tolerations", pool.tolerations)
    check_affinity(f"{r.path}.affinity", pool.affinity)
    if pool.max_replicas < pool.min_replicas:
        raise SpecError(f"{r.path}.maxReplicas", "must be >= minReplicas")
    if not pool.min_replicas <= pool.replicas <= pool.max_replicas:
        raise SpecError(f"{r.path}.replicas", "must lie within [minReplicas, maxReplicas]")
    if pool.kv_cache_bytes is not None and pool.kv_cache_fraction is not None:
        raise SpecError(r.path, "set at most one of kvCacheBytes and kvCacheFraction")
    if pool.kv_cache_fraction is not None and not 0 < pool.kv_cache_fraction <= 1:
        raise SpecError(f"{r.path}.kvCacheFraction", "must lie in (0, 1]")
    return pool


def check_speculative(path: str, role: str, value: str) -> None:
    """``spec.decode.speculative``: the decode workers' ``--speculative``, checked here."""
    if not value:
        return
    if role != "decode":
        raise SpecError(path, "speculative decoding runs on decode workers: set spec.decode")
    from pdserve.engine.spec_config import parse_speculative

    try:
        parse_speculative(value)
    except ValueError as exc:
        raise SpecError(path, str(exc)) from None


def parse_router(r: _Reader) -> RouterSpec:
    ingress = None
    if r.data.get("ingress") is not None:
        i = r.sub("ingress")
        ingress = IngressSpec(
            host=i.get("host", str, ""),
            class_name=i.get("className", str, ""),
            annotations=i.get("annotations", Mapping, {}),
            tls_secret_name=i.get("tlsSecretName", str, ""),
        )
        if not ingress.host:
            raise SpecError(f"{i.path}.host", "is required")
    key = r.sub("apiKeySecret")
    gateway = r.sub("gatewayTokenSecret")
    tls = r.sub("extProcTLSSecret")
    for guard in (gateway, tls):
        if guard.data.get("name") and r.data.get("mode", "router") != "endpointPicker":
            raise SpecError(f"{guard.path}", "is for mode endpointPicker (the picker's ext_proc)")
    check_resources(f"{r.path}.resources", r.get("resources", Mapping, {}))
    check_tolerations(f"{r.path}.tolerations", r.obj_list("tolerations"))
    return RouterSpec(
        replicas=r.number("replicas", 1, minimum=1),
        service_type=r.choice("serviceType", SERVICE_TYPES, "ClusterIP"),
        ingress=ingress,
        api_key_secret=key.get("name", str, ""),
        api_key_key=key.get("key", str, "api-key"),
        routing=r.choice("routing", ("prefix", "round-robin"), "prefix"),
        prefix_weight=r.number("prefixWeight", minimum=0),
        load_weight=r.number("loadWeight", minimum=0),
        disagg_threshold=r.number("disaggThreshold", minimum=0),
        pd_handoff=r.choice("pdHandoff", ("router", "decode"), "router"),
        max_queue=r.number("maxQueue", minimum=1),
        resources=r.get("resources", Mapping, {}),
        node_selector=r.get("nodeSelector", Mapping, {}),
        tolerations=r.obj_list("tolerations"),
        extra_args=r.str_list("extraArgs"),
        pod_template=_pod_template(r),
        http_route_parents=r.sub("httpRoute").obj_list("parentRefs"),
        http_route_hostnames=r.sub("httpRoute").str_list("hostnames"),
        mode=_router_mode(r, ingress),
        limits=_router_limits(r.sub("limits")),
        gateway_token_secret=gateway.get("name", str, ""),
        gateway_token_key=gateway.get("key", str, "token"),
        ext_proc_tls_secret=tls.get("name", str, ""),
    )


def _router_limits(lim: _Reader) -> RouterLimits:
    return RouterLimits(
        requests_per_minute=lim.number("requestsPerMinute", 0, minimum=0),
        tokens_per_minute=lim.number("tokensPerMinute", 0, minimum=0),
        max_concurrency_per_key=lim.number("maxConcurrencyPerKey", 64, minimum=0),
    )


def _router_mode(r: _Reader, ingress: IngressSpec | None) -> str:
    mode = r.choice("mode", ("router", "endpointPicker"), "router")
    if mode == "endpointPicker" and ingress is not None:  # the gateway is the way in
        msg = "is for mode router; with endpointPicker a Gateway's HTTPRoute (router.httpRoute)"
        raise SpecError(f"{r.path}.ingress", msg + " leads to the InferencePool")
    return mode


def _pod_template(r: _Reader) -> Mapping[str, Any]:
    template: Mapping[str, Any] = r.get("podTemplate", Mapping, {})
    pt.check(f"{r.path}.podTemplate", template)
    return template


def parse_small_sections(r: _Reader) -> dict[str, Any]:
    slo, auto, kv, net = (
        r.sub("slo"),
        r.sub("autoscaling"),
        r.sub("kvTransfer"),
        r.sub("networkPolicy"),
    )
    rdma = kv.get("rdmaResourceName", str, "")
    if rdma and not _RESOURCE_NAME.match(rdma):
        msg = f"must be an extended resource name like rdma/hca_shared_devices_a, got {rdma!r}"
        raise SpecError(f"{kv.path}.rdmaResourceName", msg)
    ports = kv.sub("ucxTcpPortRange")
    start = ports.number("start", 20000, minimum=1024, maximum=65535)
    end = ports.number("end", 20031, minimum=1024, maximum=65535)
    if end < start:
        raise SpecError(f"{ports.path}.end", f"must be >= start ({start}), got {end}")
    return {
        "slo": SLOSpec(
            ttft_ms=slo.number("ttftMs", 1000, minimum=1),
            tpot_ms=slo.number("tpotMs", 100, minimum=1),
            target_attainment=slo.number("targetAttainment", 0.9, minimum=0.5, maximum=1),
        ),
        "autoscaling": AutoscalingSpec(
            enabled=auto.get("enabled", bool, False),
            interval_seconds=auto.number("intervalSeconds", 30, minimum=5),
            scale_up_stabilization_seconds=auto.number(
                "scaleUpStabilizationSeconds", 60, minimum=0
            ),
            scale_down_stabilization_seconds=auto.number(
                "scaleDownStabilizationSeconds", 300, minimum=0
            ),
            metrics_url=auto.get("metricsUrl", str, ""),
        ),
        "kv_transfer": KVTransferSpec(
            transport=kv.choice("transport", TRANSPORTS, KVTransferSpec.transport),
            ucx_tls=kv.get("ucxTls", str, ""),
            ucx_net_devices=kv.get("ucxNetDevices", str, ""),
            ucx_tcp_port_start=start,
            ucx_tcp_port_end=end,
            rdma_resource_name=rdma,
            rdma_resource_count=kv.number("rdmaResourceCount", 1, minimum=1),
            ipc_lock=kv.get("ipcLock", bool, False),
            lease_seconds=kv.number("leaseSeconds", KVTransferSpec.lease_seconds, minimum=1),
            transfer_timeout_seconds=kv.number(
                "transferTimeoutSeconds", KVTransferSpec.transfer_timeout_seconds, minimum=1
            ),
            on_transfer_failure=kv.choice("onTransferFailure", ("recompute", "fail"), "recompute"),
        ),
        "network_policy": NetworkPolicySpec(
            enabled=net.get("enabled", bool, True),
            metrics_namespaces=net.str_list("metricsNamespaces"),
            gateway_namespaces=net.str_list("gatewayNamespaces"),
        ),
    }


def parse_llmservice(obj: Mapping[str, Any], default_namespace: str = "default") -> LLMServiceSpec:
    """Parse a whole LLMService object (apiVersion, kind, metadata, spec)."""
    if obj.get("kind", "LLMService") != "LLMService":
        raise SpecError("kind", f"expected LLMService, got {obj.get('kind')!r}")
    meta = _Reader(obj.get("metadata"), "metadata")
    name = meta.get("name", str, "")
    if not _NAME.match(name) or len(name) > _MAX_NAME:
        msg = f"must be a DNS-1035 label (a-z first) of at most {_MAX_NAME} characters"
        raise SpecError("metadata.name", f"{msg}, got {name!r}")
    if n.reserved_suffix(name):
        msg = f"must not end in -{n.reserved_suffix(name)} (children use that suffix)"
        raise SpecError("metadata.name", f"{msg}, got {name!r}")
    r = _Reader(obj.get("spec"), "spec")
    if r.data.get("model") is None:
        raise SpecError("spec.model", "is required")
    svc = LLMServiceSpec(
        name=name,
        namespace=meta.get("namespace", str, default_namespace),
        model=parse_model(r.sub("model"), name),
        prefill=parse_pool(r.sub("prefill"), "prefill"),
        decode=parse_pool(r.sub("decode"), "decode"),
        router=parse_router(r.sub("router")),
        image=r.get("image", str, ""),  # "": the operator's default, resolved at render time
        image_pull_policy=r.choice(
            "imagePullPolicy", ("Always", "IfNotPresent", "Never"), "IfNotPresent"
        ),
        image_pull_secrets=r.str_list("imagePullSecrets"),
        adapters=parse_adapters(
            r.data.get("adapters"), r.sub("model").get("servedName", str, name)
        ),
        kv_tiers=parse_kv_tiers(r.sub("kvCache").sub("tiers")),
        **parse_small_sections(r),
    )
    check_autoscaling(svc)
    if svc.router.mode == "endpointPicker" and svc.autoscaling.enabled:
        # The planner reads the router's metrics; the picker serves none (the decode pods'
        # fronts do): refused rather than scaling on nothing.
        raise SpecError(
            "spec.autoscaling.enabled",
            "is not supported with router.mode endpointPicker yet (docs/router.md)",
        )
    return svc


def check_autoscaling(svc: LLMServiceSpec) -> None:
    """Refuse autoscaling inputs that would be wrong rather than merely missing."""
    auto = svc.autoscaling
    if auto.metrics_url:
        check_url("spec.autoscaling.metricsUrl", auto.metrics_url)
    if auto.enabled and svc.router.replicas > 1 and not auto.metrics_url:
        # Scraping the router Service reaches one random pod per interval: counters of
        # different pods would be diffed. Prometheus sums every router pod's series.
        raise SpecError(
            "spec.autoscaling.metricsUrl",
            "is required (a Prometheus URL) when spec.router.replicas > 1",
        )
    for pool in svc.pools:
        if auto.enabled and pool.external_scaling:
            raise SpecError(
                f"spec.{pool.role}.externalScaling",
                "cannot be true while spec.autoscaling.enabled is true",
            )
