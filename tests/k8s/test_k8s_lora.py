"""``spec.adapters``: LoRA adapters from a PVC or an image volume, mounted read-only at
/adapters/<name> in every worker and router pod and passed as ``--lora``; the CRD's schema
and the operator's parser refuse the same bad entries, and agree on the defaults."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
from k8s_helpers import apply_schema_defaults, crd_schema, minimal_llmservice, schema_errors

from pdserve.operator.render import render
from pdserve.operator.spec import SpecError
from pdserve.operator.spec_parse import parse_llmservice

ADAPTERS = [
    {"name": "sql", "source": {"pvc": {"claimName": "adapters", "path": "sql/v3"}}},
    {"name": "chat.v1", "source": {"pvc": {"claimName": "adapters", "path": "chat"}}},
    {"name": "Tone_2", "source": {"image": {"reference": "registry.example/lora/tone:2"}}},
]
# The image volume source is in Kubernetes' schema from 1.31 on.
IMAGE_VOLUME_VERSIONS = ("1.31", "1.32", "1.33", "1.34")


def _pods(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for m in render(obj):
        if m["kind"] == "Deployment":
            out[m["metadata"]["name"]] = m
    return out


def test_every_worker_and_the_router_mount_each_adapter_read_only() -> None:
    obj = minimal_llmservice(adapters=ADAPTERS)
    assert schema_errors(obj) == []
    deployments = _pods(obj)
    assert set(deployments) == {"demo-router", "demo-prefill", "demo-decode"}
    for name, dep in deployments.items():
        pod = dep["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"] if v["name"].startswith("adapters-")}
        assert vols == {  # one volume per PVC / image, however many adapters it holds
            "adapters-0": {
                "name": "adapters-0",
                "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True},
            },
            "adapters-1": {
                "name": "adapters-1",
                "image": {
                    "reference": "registry.example/lora/tone:2",
                    "pullPolicy": "IfNotPresent",
                },
            },
        }
        main = pod["containers"][0]
        mounts = [m for m in main["volumeMounts"] if m["name"].startswith("adapters-")]
        assert mounts == [
            {
                "name": "adapters-0",
                "mountPath": "/adapters/sql",
                "readOnly": True,
                "subPath": "sql/v3",
            },
            {
                "name": "adapters-0",
                "mountPath": "/adapters/chat.v1",
                "readOnly": True,
                "subPath": "chat",
            },
            {"name": "adapters-1", "mountPath": "/adapters/Tone_2", "readOnly": True},
        ], name
        cmd = main["command"]
        loras = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--lora"]
        assert loras == [
            "sql=/adapters/sql",
            "chat.v1=/adapters/chat.v1",
            "Tone_2=/adapters/Tone_2",
        ], name
        for version in IMAGE_VOLUME_VERSIONS:
            kubernetes_validate.validate(dep, version, strict=True)


def test_no_adapters_no_volumes() -> None:
    for dep in _pods(minimal_llmservice()).values():
        pod = dep["spec"]["template"]["spec"]
        assert not [v for v in pod["volumes"] if v["name"].startswith("adapters-")]
        assert "--lora" not in pod["containers"][0]["command"]


def test_adapters_are_part_of_the_pods_config() -> None:
    """Adding an adapter changes the pods (a rollout), as any other flag does."""
    plain, more = _pods(minimal_llmservice()), _pods(minimal_llmservice(adapters=ADAPTERS[:1]))
    for name in plain:
        assert plain[name]["spec"]["template"] != more[name]["spec"]["template"]


def test_crd_defaults_equal_operator_defaults_for_adapters() -> None:
    obj = minimal_llmservice(adapters=ADAPTERS)
    defaulted = apply_schema_defaults(crd_schema(), copy.deepcopy(obj))
    assert defaulted["spec"]["adapters"][2]["source"]["image"]["pullPolicy"] == "IfNotPresent"
    assert parse_llmservice(defaulted) == parse_llmservice(obj)
    spec = parse_llmservice(obj)
    assert [(a.name, a.kind, a.path) for a in spec.adapters] == [
        ("sql", "pvc", "sql/v3"),
        ("chat.v1", "pvc", "chat"),
        ("Tone_2", "image", ""),
    ]


def _one(**source: Any) -> list[dict[str, Any]]:
    return [{"name": "a", "source": source}]


BOTH_REFUSE = {
    "two sources": (_one(pvc={"claimName": "c"}, image={"reference": "r"}), "source"),
    "no source": ([{"name": "a", "source": {}}], "source"),
    "no name": ([{"source": {"pvc": {"claimName": "c"}}}], "name"),
    "slash in the name": ([{"name": "a/b", "source": {"pvc": {"claimName": "c"}}}], "name"),
    "dot name": ([{"name": "..", "source": {"pvc": {"claimName": "c"}}}], "name"),
    "path leaves the volume": (_one(pvc={"claimName": "c", "path": "../x"}), "path"),
    "absolute path": (_one(pvc={"claimName": "c", "path": "/x"}), "path"),
    "no claim": (_one(pvc={"path": "x"}), "claimName"),
    "no image reference": (_one(image={"path": "x"}), "reference"),
    "pull policy": (_one(image={"reference": "r", "pullPolicy": "Sometimes"}), "pullPolicy"),
}


@pytest.mark.parametrize("case", sorted(BOTH_REFUSE))
def test_schema_and_parser_refuse_bad_adapters(case: str) -> None:
    adapters, field = BOTH_REFUSE[case]
    obj = minimal_llmservice(adapters=adapters)
    errors = schema_errors(obj)
    assert errors, case
    with pytest.raises(SpecError) as info:
        parse_llmservice(apply_schema_defaults(crd_schema(), copy.deepcopy(obj)))
    assert info.value.field.startswith("spec.adapters[0]") and field in info.value.field


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        (ADAPTERS[:1] * 2, "given twice"),  # the API server: x-kubernetes-list-map-keys
        ([{"name": "demo", "source": {"pvc": {"claimName": "c"}}}], "base model's name"),
    ],
)
def test_parser_refuses_duplicate_and_base_names(adapters: Any, message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        parse_llmservice(minimal_llmservice(adapters=adapters))
    assert info.value.field.endswith(".name")


def test_endpoint_picker_fronts_serve_the_adapters() -> None:
    """In endpointPicker mode each decode pod's front is the router that serves the tenants:
    it gets the same --lora flags and the adapter mounts (it hashes the adapters' files),
    else an adapter's name would be a 404 behind the gateway."""
    obj = minimal_llmservice(adapters=ADAPTERS, router={"mode": "endpointPicker"})
    pod = _pods(obj)["demo-decode"]["spec"]["template"]["spec"]
    front = next(c for c in pod["containers"] if c["name"] == "front")
    cmd = front["command"]
    loras = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--lora"]
    assert loras == ["sql=/adapters/sql", "chat.v1=/adapters/chat.v1", "Tone_2=/adapters/Tone_2"]
    mounts = {m["mountPath"] for m in front["volumeMounts"] if m["name"].startswith("adapters-")}
    assert mounts == {"/adapters/sql", "/adapters/chat.v1", "/adapters/Tone_2"}
    assert all(m["readOnly"] for m in front["volumeMounts"] if m["name"].startswith("adapters-"))
