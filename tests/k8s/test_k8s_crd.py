"""The CRD's schema refuses bad LLMServices; its defaults agree with the operator's.

The emulator does no schema validation, so the tests validate objects the way
the API server would: structural defaults, the openAPIV3Schema (jsonschema,
Draft 4 = OpenAPI v3.0 semantics) and every CEL rule (cel-python).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from k8s_helpers import (
    apply_schema_defaults,
    cel_errors,
    crd_schema,
    load_crd,
    minimal_llmservice,
    schema_errors,
)

from pdserve.operator.spec import SpecError
from pdserve.operator.spec_parse import parse_llmservice


def with_spec(**changes: Any) -> dict[str, Any]:
    obj = minimal_llmservice()
    obj["spec"].update(copy.deepcopy(changes))
    return obj


def named(name: str) -> dict[str, Any]:
    return minimal_llmservice(name)


NEAR = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Near"}]}]}
AFFINITY_BAD_OP = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": NEAR}}

INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "name starts with a digit": (named("3b-chat"), "DNS-1035"),
    "autoscaling two routers without Prometheus": (
        with_spec(autoscaling={"enabled": True}, router={"replicas": 2}),
        "needs autoscaling.metricsUrl",
    ),
    "external scaling with autoscaling": (
        with_spec(autoscaling={"enabled": True}, decode={"externalScaling": True}),
        "externalScaling cannot be true",
    ),
    "UCX port range reversed": (
        with_spec(kvTransfer={"ucxTcpPortRange": {"start": 21000, "end": 20000}}),
        "end must be >= start",
    ),
    "name with a child suffix": (named("chat-prefill"), "must not end in"),
    "cpu is not a quantity": (
        with_spec(prefill={"resources": {"requests": {"cpu": "lots"}}}),
        "'lots' does not match",
    ),
    "shm size is not a quantity": (with_spec(decode={"shmSize": "big"}), "'big' does not match"),
    "toleration operator": (
        with_spec(decode={"tolerations": [{"key": "gpu", "operator": "Maybe"}]}),
        "'Maybe' is not one of",
    ),
    "pd handoff": (with_spec(router={"pdHandoff": "prefill"}), "'prefill' is not one of"),
    "router toleration effect": (
        with_spec(router={"tolerations": [{"key": "gpu", "effect": "Never"}]}),
        "'Never' is not one of",
    ),
    "affinity operator": (with_spec(prefill={"affinity": AFFINITY_BAD_OP}), "'Near' is not one of"),
    "no model": (
        {**minimal_llmservice(), "spec": {"image": "x"}},
        "'model' is a required property",
    ),
    "two model sources": (
        with_spec(model={"source": {"hostPath": {"path": "/m"}, "pvc": {"claimName": "c"}}}),
        "has too many properties",
    ),
    "unknown dtype": (
        with_spec(model={"source": {"hostPath": {"path": "/m"}}, "dtype": "int4"}),
        "int4",
    ),
    "max < min replicas": (
        with_spec(decode={"minReplicas": 3, "maxReplicas": 2, "replicas": 3}),
        "maxReplicas must be >= minReplicas",
    ),
    "replicas above max": (with_spec(prefill={"replicas": 9}), "replicas must lie within"),
    "negative replicas": (with_spec(prefill={"replicas": -1}), "-1 is less than the minimum"),
    "unknown transport": (with_spec(kvTransfer={"transport": "rdma"}), "'rdma' is not one of"),
    "unknown service type": (
        with_spec(router={"serviceType": "External"}),
        "'External' is not one of",
    ),
    "attainment above 1": (
        with_spec(slo={"targetAttainment": 1.5}),
        "1.5 is greater than the maximum",
    ),
    "kv bytes and fraction": (
        with_spec(prefill={"kvCacheBytes": 1 << 30, "kvCacheFraction": 0.5}),
        "at most one of kvCacheBytes and kvCacheFraction",
    ),
    "relative hostPath": (
        with_spec(model={"source": {"hostPath": {"path": "models"}}}),
        "does not match",
    ),
    "bad RDMA resource name": (
        with_spec(kvTransfer={"rdmaResourceName": "mlx5"}),
        "does not match",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_schema_refuses_invalid(case: str) -> None:
    obj, expected = INVALID[case]
    errors = schema_errors(obj)
    assert any(expected in e for e in errors), f"{case}: {errors}"


@pytest.mark.parametrize("case", sorted(INVALID))
def test_operator_parser_refuses_what_the_schema_refuses(case: str) -> None:
    """``pdserve render`` never sees the API server: its own checks must refuse the same specs."""
    obj, _ = INVALID[case]
    with pytest.raises(SpecError) as info:
        parse_llmservice(apply_schema_defaults(crd_schema(), copy.deepcopy(obj)))
    assert info.value.field.startswith(("spec", "metadata"))


def test_minimal_is_valid() -> None:
    assert schema_errors(minimal_llmservice()) == []


def test_cel_rules_evaluate_both_ways() -> None:
    pool = crd_schema()["properties"]["spec"]["properties"]["prefill"]
    ok = {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}
    assert cel_errors(pool, ok) == []
    assert cel_errors(pool, {**ok, "maxReplicas": 0, "minReplicas": 1, "replicas": 1}) != []
    assert cel_errors(pool, {**ok, "kvCacheBytes": 1 << 30}) == []
    assert len(cel_errors(pool, {**ok, "kvCacheBytes": 1 << 30, "kvCacheFraction": 0.5})) == 1


def test_crd_defaults_equal_operator_defaults() -> None:
    """``parse_llmservice`` fills the same defaults as the API server would from the CRD."""
    obj = minimal_llmservice()
    defaulted = apply_schema_defaults(crd_schema(), copy.deepcopy(obj))
    assert defaulted["spec"]["prefill"]["maxReplicas"] == 4  # the walk really applied defaults
    assert parse_llmservice(defaulted) == parse_llmservice(obj)
    hf = minimal_llmservice(
        model={"source": {"huggingFace": {"id": "org/m", "tokenSecret": {"name": "t"}}}}
    )
    assert parse_llmservice(
        apply_schema_defaults(crd_schema(), copy.deepcopy(hf))
    ) == parse_llmservice(hf)


def test_crd_shape() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == "llmservices.pdserve.io"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Prefill", "Decode", "Ready", "Endpoint", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    decision = status["autoscaling"]["properties"]["lastDecision"]["properties"]
    assert set(decision) == {"time", "prefillReplicas", "decodeReplicas", "reason"}
    assert {"observedGeneration", "conditions", "endpoint", "prefill", "decode"} <= set(status)
