"""``spec.router.mode: endpointPicker``: the InferencePool, the picker and the decode pods'
fronts, validated against the Inference Extension's published InferencePool CRD (vendored
in tests/fixtures/ with its version) and, for the core kinds, kubernetes-validate."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import jsonschema
import pytest
import yaml
from k8s_helpers import (
    NS,
    ROOT,
    apply_schema_defaults,
    cel_errors,
    eventually,
    minimal_llmservice,
    schema_errors,
)
from test_k8s_manifests import validate_builtin
from test_k8s_operator import wait_children

from pdserve.operator.kube import KubeClient
from pdserve.operator.render import optional_children, render
from pdserve.operator.render_picker import FRONT_PORT, GRPC_PORT, INFERENCE_API
from pdserve.operator.spec import SpecError
from pdserve.router.main import add_arguments

POOL_CRD = ROOT / "tests" / "fixtures" / "inference.networking.k8s.io_inferencepools.v1.6.0.yaml"
PARENT = {"parentRefs": [{"name": "inference-gateway"}]}


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(POOL_CRD.read_text())
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1" and crd["spec"]["group"] == "inference.networking.k8s.io"
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def pool_errors(obj: dict[str, Any]) -> list[str]:
    """What the API server would refuse of an InferencePool: schema, then CEL rules."""
    schema = pool_schema()
    obj = apply_schema_defaults(schema, copy.deepcopy(obj))
    errors = [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]
    return errors or cel_errors(schema, obj)


def picker_children(**router: Any) -> dict[tuple[str, str], dict[str, Any]]:
    obj = minimal_llmservice(router={"mode": "endpointPicker", **router})
    assert schema_errors(obj) == []
    return {(c["kind"], c["metadata"]["name"]): c for c in render(obj)}


def router_args(command: list[str]) -> argparse.Namespace:
    """The command as ``pdserve router`` itself parses it."""
    assert command[:2] == ["pdserve", "router"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(command[2:])


def test_inference_pool_valid_against_the_published_crd() -> None:
    kids = picker_children()
    pool = kids[("InferencePool", "demo")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool_errors(pool) == []
    spec = pool["spec"]
    decode = kids[("Deployment", "demo-decode")]
    assert spec["selector"]["matchLabels"] == decode["spec"]["selector"]["matchLabels"]
    assert spec["targetPorts"] == [{"number": FRONT_PORT}]
    ref = spec["endpointPickerRef"]
    svc = kids[("Service", ref["name"])]
    assert [p["port"] for p in svc["spec"]["ports"]] == [ref["port"]["number"]] == [GRPC_PORT]
    picker = kids[("Deployment", "demo-router")]
    assert (
        svc["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    )


@pytest.mark.parametrize(
    ("change", "bad"),
    [
        (lambda s: s.update(targetPorts=[]), "no target port"),
        (lambda s: s.update(targetPorts=[{"number": 8084}, {"number": 8084}]), "duplicate ports"),
        (lambda s: s["endpointPickerRef"].pop("port"), "a Service without a port"),
        (lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"), "bad failure mode"),
        (lambda s: s["selector"].update(matchLabels={}), "empty selector"),
    ],
)
def test_the_vendored_crd_refuses_bad_pools(change: Any, bad: str) -> None:
    pool = copy.deepcopy(picker_children()[("InferencePool", "demo")])
    change(pool["spec"])
    assert pool_errors(pool) != [], bad


def test_core_kinds_valid() -> None:
    kids = picker_children(httpRoute=PARENT, apiKeySecret={"name": "keys"})
    for (kind, _), doc in kids.items():
        if kind not in ("InferencePool", "HTTPRoute"):
            validate_builtin(doc)


def test_picker_deployment_runs_the_picker() -> None:
    dep = picker_children()[("Deployment", "demo-router")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    args = router_args(c["command"])
    assert (args.mode, args.grpc_port, args.target_port) == (
        "endpoint-picker",
        GRPC_PORT,
        FRONT_PORT,
    )
    assert args.discovery == "kubernetes" and args.service == "demo"
    ports = [(p["name"], p["containerPort"]) for p in c["ports"]]
    assert ports == [("grpc", GRPC_PORT), ("admin", args.admin_port)]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(args.admin_port)  # its routing series
    probes = {
        k: c[k]["grpc"]["service"] for k in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert probes == {
        "startupProbe": "liveness",
        "readinessProbe": "readiness",
        "livenessProbe": "liveness",
    }


def test_decode_pods_get_a_front() -> None:
    dep = picker_children(apiKeySecret={"name": "keys"})[("Deployment", "demo-decode")]
    pod = dep["spec"]["template"]["spec"]
    worker, front = pod["containers"]
    assert worker["name"] == "decode" and front["name"] == "front"
    args = router_args(front["command"])
    assert args.prefill_from_header and args.mode == "router" and args.port == FRONT_PORT
    assert args.decode == ["http://127.0.0.1:8080"]  # this pod's own decode worker
    assert args.api_key_file.startswith("/etc/pdserve/api-key/")
    assert {v["name"] for v in pod["volumes"]} >= {"api-key", "model", "tmp"}
    assert front["readinessProbe"]["httpGet"] == {"path": "/health", "port": "front"}
    env = {e["name"] for e in front["env"]}
    assert "PDSERVE_SERVICE_SECRET" in env  # it checks the picker's signed prefill header


def test_http_route_leads_to_the_pool_and_the_front_port_is_open() -> None:
    kids = picker_children(httpRoute=PARENT)
    route = kids[("HTTPRoute", "demo")]
    pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo"}
    assert [r["backendRefs"] for r in route["spec"]["rules"]] == [[pool_ref]]
    obj = minimal_llmservice(router={"mode": "endpointPicker"}, networkPolicy={"enabled": True})
    policy = next(c for c in render(obj) if c["kind"] == "NetworkPolicy")
    assert {"ports": [{"protocol": "TCP", "port": FRONT_PORT}]} in policy["spec"]["ingress"]
    assert ("inference.networking.k8s.io/v1", "InferencePool", "demo") in optional_children("demo")


def test_router_mode_is_the_default_and_unchanged() -> None:
    plain = render(minimal_llmservice())
    assert render(minimal_llmservice(router={"mode": "router"})) == plain
    assert not any(c["kind"] == "InferencePool" for c in plain)
    decode = next(
        c for c in plain if (c["kind"], c["metadata"]["name"]) == ("Deployment", "demo-decode")
    )
    assert len(decode["spec"]["template"]["spec"]["containers"]) == 1


@pytest.mark.parametrize(
    ("router", "extra", "field"),
    [
        ({"mode": "endpointPicker", "ingress": {"host": "llm.example"}}, {}, "spec.router.ingress"),
        (
            {"mode": "endpointPicker"},
            {"autoscaling": {"enabled": True}},
            "spec.autoscaling.enabled",
        ),
        ({"mode": "picker"}, {}, "spec.router.mode"),
    ],
)
def test_refused_combinations(router: dict[str, Any], extra: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        render(minimal_llmservice(router=router, **extra))
    assert field in str(err.value)


def test_llmservice_crd_knows_the_mode() -> None:
    assert schema_errors(minimal_llmservice(router={"mode": "endpointPicker"})) == []
    assert schema_errors(minimal_llmservice(router={"mode": "picker"})) != []


async def test_operator_applies_and_prunes_the_pool(operator: None, client: KubeClient) -> None:
    """The operator (kopf against the emulated API server) creates the InferencePool as an
    adopted child with the rest, and prunes it when the mode goes back to router."""
    obj = minimal_llmservice(router={"mode": "endpointPicker"})
    await client.create(obj)
    kids = await wait_children(client, obj)
    pool = kids["InferencePool/demo"]
    owner = await client.get("pdserve.io/v1alpha1", "LLMService", NS, "demo")
    assert owner is not None
    refs = pool["metadata"]["ownerReferences"]
    assert [(r["kind"], r["uid"]) for r in refs] == [("LLMService", owner["metadata"]["uid"])]
    assert pool_errors(pool) == []
    decode = kids["Deployment/demo-decode"]["spec"]["template"]["spec"]
    assert [c["name"] for c in decode["containers"]] == ["decode", "front"]
    patch = {"spec": {"router": {"mode": "router"}}}
    await client.patch("pdserve.io/v1alpha1", "LLMService", NS, "demo", patch)

    async def pruned() -> bool:
        gone = await client.get(INFERENCE_API, "InferencePool", NS, "demo") is None
        dep = await client.get("apps/v1", "Deployment", NS, "demo-decode")
        return gone and dep is not None and len(dep["spec"]["template"]["spec"]["containers"]) == 1

    await eventually(pruned, what="InferencePool pruned, the front gone")


def test_only_the_gateway_reaches_the_picker() -> None:
    """Issue 44 item 2: ``gatewayTokenSecret`` makes the picker refuse ext_proc streams
    without the gateway's credential, and ``networkPolicy.gatewayNamespaces`` opens the
    gRPC port to the gateway's namespaces alone. Before: open to every pod, any stream
    taken (its ``served`` metadata believed)."""
    obj = minimal_llmservice(
        router={"mode": "endpointPicker", "gatewayTokenSecret": {"name": "gw"}},
        networkPolicy={"gatewayNamespaces": ["gateway-system"]},
    )
    assert schema_errors(obj) == []
    kids = {(c["kind"], c["metadata"]["name"]): c for c in render(obj)}
    pod = kids[("Deployment", "demo-router")]["spec"]["template"]["spec"]
    args = router_args(pod["containers"][0]["command"])
    assert args.gateway_token_file == "/etc/pdserve/gateway-token/token"
    volume = next(v for v in pod["volumes"] if v["name"] == "gateway-token")
    assert volume["secret"]["secretName"] == "gw"
    assert any(m["name"] == "gateway-token" for m in pod["containers"][0]["volumeMounts"])
    rules = kids[("NetworkPolicy", "demo-router")]["spec"]["ingress"]
    grpc_rule = next(r for r in rules if r["ports"][0]["port"] == GRPC_PORT)
    selector = grpc_rule["from"][0]["namespaceSelector"]["matchExpressions"][0]
    assert selector["values"] == ["gateway-system"]
    with pytest.raises(SpecError, match=r"^spec.router.gatewayTokenSecret"):
        render(minimal_llmservice(router={"gatewayTokenSecret": {"name": "gw"}}))


def test_mutual_tls_on_the_ext_proc_port() -> None:
    """Issue 44 item 2: ``extProcTLSSecret`` (a kubernetes.io/tls Secret with ca.crt, as
    cert-manager writes it) is mounted into the picker's pod, never read by the operator,
    and names the picker's certificate, key and client CA; the kubelet's probes move to
    the admin port's HTTP health (its gRPC probe speaks no TLS)."""
    obj = minimal_llmservice(router={"mode": "endpointPicker", "extProcTLSSecret": {"name": "pk"}})
    assert schema_errors(obj) == []
    kids = {(c["kind"], c["metadata"]["name"]): c for c in render(obj)}
    pod = kids[("Deployment", "demo-router")]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = router_args(c["command"])
    tls_dir = "/etc/pdserve/ext-proc-tls"
    assert (args.ext_proc_tls_cert, args.ext_proc_tls_key, args.ext_proc_client_ca) == (
        f"{tls_dir}/tls.crt",
        f"{tls_dir}/tls.key",
        f"{tls_dir}/ca.crt",
    )
    volume = next(v for v in pod["volumes"] if v["name"] == "ext-proc-tls")
    assert volume["secret"]["secretName"] == "pk"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "ext-proc-tls")
    assert mount == {"name": "ext-proc-tls", "mountPath": tls_dir, "readOnly": True}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "admin" and "grpc" not in c[probe]
    with pytest.raises(SpecError, match=r"^spec.router.extProcTLSSecret"):
        render(minimal_llmservice(router={"extProcTLSSecret": {"name": "pk"}}))
