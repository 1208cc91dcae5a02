"""Where an LLMService may be reached from (issue 44 item 13; operator/exposure.py): a team
that may create LLMServices in its own namespace gets no LoadBalancer or NodePort, no
Ingress class or host and no other namespace's Gateway that the platform team did not
allow, and no exposed service without API keys. Each case renders when the policy is off
(so the test fails if the policy lets it through)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from k8s_helpers import minimal_llmservice

from pdserve.operator import main
from pdserve.operator.exposure import ExposurePolicy
from pdserve.operator.pod_policy import PodPolicy
from pdserve.operator.render import render
from pdserve.operator.spec import SpecError

KEY = {"apiKeySecret": {"name": "keys"}}
POLICY = PodPolicy(
    model_host_paths=("/data/models",),  # minimal_llmservice's weights
    exposure=ExposurePolicy(
        service_types=("ClusterIP",),
        ingress_classes=("public-nginx",),
        host_suffixes=("llm.example.com",),
        gateway_namespaces=("gateways",),
    ),
)
INGRESS = {"host": "team-a.llm.example.com", "className": "public-nginx"}

# (router spec, the field the refusal names)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "a LoadBalancer": ({"serviceType": "LoadBalancer", **KEY}, "spec.router.serviceType"),
    "a NodePort": ({"serviceType": "NodePort", **KEY}, "spec.router.serviceType"),
    "another Ingress class": (
        {"ingress": {**INGRESS, "className": "internal"}, **KEY},
        "spec.router.ingress.className",
    ),
    "the default Ingress class": (
        {"ingress": {"host": INGRESS["host"]}, **KEY},
        "spec.router.ingress.className",
    ),
    "a foreign host": (
        {"ingress": {**INGRESS, "host": "login.example.com"}, **KEY},
        "spec.router.ingress.host",
    ),
    "a look-alike host": (
        {"ingress": {**INGRESS, "host": "evil-llm.example.com"}, **KEY},
        "spec.router.ingress.host",
    ),
    "a foreign route hostname": (
        {"httpRoute": {"parentRefs": [{"name": "gw"}], "hostnames": ["x.example.org"]}, **KEY},
        r"spec.router.httpRoute.hostnames\[0\]",
    ),
    "another namespace's Gateway": (
        {"httpRoute": {"parentRefs": [{"name": "gw", "namespace": "kube-system"}]}, **KEY},
        r"spec.router.httpRoute.parentRefs\[0\].namespace",
    ),
    "an Ingress without keys": ({"ingress": INGRESS}, "spec.router.apiKeySecret"),
    "a picker open to a gateway with neither mTLS nor a gateway token": (
        {"mode": "endpointPicker", "httpRoute": {"parentRefs": [{"name": "gw"}]}, **KEY},
        "spec.router.extProcTLSSecret",
    ),
    "a route without keys": (
        {"httpRoute": {"parentRefs": [{"name": "gw"}]}},
        "spec.router.apiKeySecret",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_exposure_beyond_the_platform_teams_limits_is_refused(case: str) -> None:
    router, field = REFUSED[case]
    obj = minimal_llmservice(router=router)
    with pytest.raises(SpecError, match=rf"^{field}: "):
        render(obj, policy=POLICY)
    assert render(obj)  # without a policy (a cluster admin's render) it would be made


def test_exposure_within_the_limits_renders() -> None:
    route = {"parentRefs": [{"name": "gw", "namespace": "gateways"}, {"name": "own"}]}
    router = {"ingress": INGRESS, "httpRoute": {**route, "hostnames": ["llm.example.com"]}}
    kinds = {m["kind"] for m in render(minimal_llmservice(router={**router, **KEY}), policy=POLICY)}
    assert {"Ingress", "HTTPRoute"} <= kinds
    assert render(minimal_llmservice(), policy=POLICY)  # ClusterIP, no keys: not exposed
    picker = {"mode": "endpointPicker", "httpRoute": {"parentRefs": [{"name": "gw"}]}, **KEY}
    for guard in ({"extProcTLSSecret": {"name": "tls"}}, {"gatewayTokenSecret": {"name": "t"}}):
        assert render(minimal_llmservice(router={**picker, **guard}), policy=POLICY)


def test_the_operators_flags_build_the_policy() -> None:
    """Default: ClusterIP only; the flags add what the platform team allows."""
    assert ExposurePolicy().service_types == ("ClusterIP",)
    argv = [
        "--allow-service-type=LoadBalancer",
        "--allow-ingress-class=public-nginx",
        "--allow-host-suffix=llm.example.com",
        "--allow-gateway-namespace=gateways",
    ]
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    assert main.pod_policy(parser.parse_args([])).exposure == ExposurePolicy()
    policy = main.pod_policy(parser.parse_args(argv)).exposure
    assert policy == ExposurePolicy(
        ("ClusterIP", "LoadBalancer"), ("public-nginx",), ("llm.example.com",), ("gateways",)
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--allow-service-type=ExternalName"])
