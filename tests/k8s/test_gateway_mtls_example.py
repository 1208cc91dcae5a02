"""examples/gateway-mtls/ (issue 44 item 2): the gateway side of the picker's mutual TLS
(Envoy Gateway presenting a client certificate to :9002, cert-manager issuing both
ends). The example's files parse, its LLMService passes the CRD's schema, and every name
the gateway side uses is the one the operator renders: the picker's TLS Secret, its
Service, port and DNS name, the CA that signs the gateway's certificate, the namespace
the NetworkPolicy opens :9002 to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from k8s_helpers import schema_errors

from pdserve.operator import naming as n
from pdserve.operator.exposure import ExposurePolicy, exposure_violations
from pdserve.operator.render import render
from pdserve.operator.render_picker import GRPC_PORT
from pdserve.operator.spec_parse import parse_llmservice

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway-mtls"


def _docs(name: str) -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((EXAMPLE / name).read_text()) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_gateway_side_names_what_the_operator_renders() -> None:
    (svc_obj,) = _docs("llmservice.yaml").values()
    assert schema_errors(svc_obj) == []
    name, ns = svc_obj["metadata"]["name"], svc_obj["metadata"]["namespace"]
    # The operator's exposure policy takes it once the admin allows the gateway's namespace
    # (chart: operator.allowedGatewayNamespaces), and not before.
    spec = parse_llmservice(svc_obj)
    assert [f for f, _ in exposure_violations(spec, ExposurePolicy())] == [
        "spec.router.httpRoute.parentRefs[0].namespace"
    ]
    allowed = ExposurePolicy(gateway_namespaces=("envoy-gateway-system",))
    assert list(exposure_violations(spec, allowed)) == []
    kids = {(m["kind"], m["metadata"]["name"]): m for m in render(svc_obj)}
    certs, gateway = _docs("certificates.yaml"), _docs("envoy-gateway.yaml")

    # The picker mounts the Secret the picker's Certificate writes, and serves TLS with it.
    picker = kids[("Deployment", n.deployment_name(name, "router"))]["spec"]["template"]["spec"]
    secret = svc_obj["spec"]["router"]["extProcTLSSecret"]["name"]
    assert {"secretName": secret, "defaultMode": 0o440} in [
        v.get("secret") for v in picker["volumes"]
    ]
    assert "--ext-proc-client-ca" in picker["containers"][0]["command"]
    server = certs[("Certificate", secret)]["spec"]
    assert server["secretName"] == secret and "server auth" in server["usages"]
    assert certs[("Certificate", secret)]["metadata"]["namespace"] == ns

    # The gateway dials the picker's Service on its grpc port (9002, the InferencePool's
    # endpointPickerRef), checks the name the picker's certificate carries, with the CA.
    service = kids[("Service", n.router_service_name(name))]
    (port,) = service["spec"]["ports"]
    pool = kids[("InferencePool", name)]["spec"]["endpointPickerRef"]
    assert port["port"] == GRPC_PORT == pool["port"]["number"]
    assert pool["name"] == service["metadata"]["name"]
    policy = gateway[("BackendTLSPolicy", f"{name}-picker-tls")]
    assert policy["metadata"]["namespace"] == ns  # a policy lives with its Service
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"], target["sectionName"]) == (
        "Service",
        service["metadata"]["name"],
        port["name"],
    )
    hostname = policy["spec"]["validation"]["hostname"]
    assert hostname == f"{service['metadata']['name']}.{ns}.svc" in server["dnsNames"]

    # The gateway's client certificate: the EnvoyProxy's, signed by the same CA issuer as
    # the picker's (whose ca.crt the picker checks clients against), for client auth.
    proxy = gateway[("EnvoyProxy", "pdserve")]
    ref = proxy["spec"]["backendTLS"]["clientCertificateRef"]
    (client,) = [c for c in certs.values() if c["spec"].get("secretName") == ref["name"]]
    assert client["metadata"]["namespace"] == ref["namespace"] == proxy["metadata"]["namespace"]
    assert "client auth" in client["spec"]["usages"]
    assert client["spec"]["issuerRef"] == server["issuerRef"]
    issuer = certs[("ClusterIssuer", server["issuerRef"]["name"])]["spec"]["ca"]
    assert certs[("Certificate", issuer["secretName"])]["spec"]["isCA"] is True

    # The proxies that present it are the Gateway's, its class parameterised by the
    # EnvoyProxy; the HTTPRoute's parent is that Gateway; :9002 opens to their namespace.
    gw = gateway[("Gateway", "pdserve")]
    klass = gateway[("GatewayClass", gw["spec"]["gatewayClassName"])]["spec"]["parametersRef"]
    assert (klass["kind"], klass["name"]) == ("EnvoyProxy", proxy["metadata"]["name"])
    (parent,) = kids[("HTTPRoute", name)]["spec"]["parentRefs"]
    assert (parent["name"], parent["namespace"]) == (
        gw["metadata"]["name"],
        gw["metadata"]["namespace"],
    )
    rules = kids[("NetworkPolicy", f"{name}-router")]["spec"]["ingress"]
    (grpc,) = [r for r in rules if r["ports"] == [{"protocol": "TCP", "port": GRPC_PORT}]]
    allowed = grpc["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"]
    assert allowed == [gw["metadata"]["namespace"]]
