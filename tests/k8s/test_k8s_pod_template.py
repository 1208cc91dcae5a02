"""The pod-template escape hatch merged over rendered pods (``pdserve render`` output)."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import minimal_llmservice, schema_errors

from pdserve.operator.render import render
from pdserve.operator.spec import SpecError

MULTUS = "k8s.v1.cni.cncf.io/networks"
DECODE_TEMPLATE = {
    "metadata": {"labels": {"team": "ml"}, "annotations": {MULTUS: "sriov-rdma"}},
    "spec": {
        "runtimeClassName": "nvidia",
        "priorityClassName": "llm-serving",
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"pdserve.io/role": "decode"}},
            },
        ],
        "containers": [
            {
                "name": "decode",
                "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            },
            {"name": "sidecar", "image": "busybox:1.36", "command": ["sleep", "infinity"]},
        ],
        "volumes": [
            {"name": "scratch", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {"medium": "Memory"}},
        ],
    },
}


def decode_template(obj: dict[str, Any]) -> dict[str, Any]:
    dep = next(
        m
        for m in render(obj)
        if m["metadata"]["name"] == "demo-decode" and m["kind"] == "Deployment"
    )
    template: dict[str, Any] = dep["spec"]["template"]
    return template


def test_template_merges_over_the_rendered_pod() -> None:
    obj = minimal_llmservice(decode={"podTemplate": DECODE_TEMPLATE})
    assert schema_errors(obj) == []
    plain = decode_template(minimal_llmservice())
    t = decode_template(obj)
    meta, pod = t["metadata"], t["spec"]
    assert meta["labels"]["team"] == "ml" and meta["labels"]["pdserve.io/role"] == "decode"
    assert meta["annotations"][MULTUS] == "sriov-rdma"
    assert meta["annotations"]["pdserve.io/config-hash"]  # rendered keys stay
    assert pod["runtimeClassName"] == "nvidia" and pod["priorityClassName"] == "llm-serving"
    assert pod["topologySpreadConstraints"][0]["maxSkew"] == 1
    main, sidecar = pod["containers"]
    assert main["command"] == plain["spec"]["containers"][0]["command"]  # merged by name
    env = {e["name"] for e in main["env"]}
    assert {"NCCL_DEBUG", "POD_NAME", "PDSERVE_SERVICE_SECRET"} <= env
    assert {m["mountPath"] for m in main["volumeMounts"]} >= {"/scratch", "/models", "/tmp"}
    assert sidecar["image"] == "busybox:1.36"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["scratch"] == {"name": "scratch", "emptyDir": {}}
    assert vols["tmp"]["emptyDir"] == {"medium": "Memory"}  # same name: merged over ours
    # Other pools are untouched.
    router = next(
        m
        for m in render(obj)
        if m["metadata"]["name"] == "demo-router" and m["kind"] == "Deployment"
    )
    assert "runtimeClassName" not in router["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    "template, field",
    [
        ({"metadata": {"labels": {"pdserve.io/role": "x"}}}, "metadata.labels.pdserve.io/role"),
        ({"metadata": {"labels": {"pdserve.io/service": "x"}}}, "pdserve.io/service"),
        ({"replicas": 3}, "spec.router.podTemplate.replicas"),
    ],
)
def test_template_cannot_break_the_pod_contract(template: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as info:
        render(minimal_llmservice(router={"podTemplate": template}))
    assert field in str(info.value)


def test_schema_checks_typed_template_fields() -> None:
    bad = {
        "spec": {
            "topologySpreadConstraints": [
                {"maxSkew": 0, "topologyKey": "zone", "whenUnsatisfiable": "Maybe"}
            ]
        }
    }
    errors = schema_errors(minimal_llmservice(prefill={"podTemplate": bad}))
    assert any("'Maybe' is not one of" in e for e in errors), errors
