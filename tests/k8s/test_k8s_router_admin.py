"""The router's admin port in rendering: with API keys on, its /metrics refuses a keyless
scrape on the HTTP port, so the operator's autoscaler and Prometheus must reach it on
``--admin-port`` through an internal Service, never through the Ingress or HTTPRoute."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
from k8s_helpers import minimal_llmservice
from starlette.requests import Request

from pdserve.operator.autoscale_inputs import router_metrics_url
from pdserve.operator.render import render
from pdserve.router.api_keys import KeyStore
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.main import add_arguments
from pdserve.router.runtime import Runtime

KEY = {"name": "llm-key", "key": "api-key"}
ROUTE = {"parentRefs": [{"name": "public"}]}


def _service(**router: Any) -> dict[str, dict[str, Any]]:
    obj = minimal_llmservice(router={"apiKeySecret": KEY, **router})
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in render(obj)}


def _router(m: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = m["Deployment/demo-router"]["spec"]["template"]
    return {"annotations": spec["metadata"]["annotations"], **spec["spec"]["containers"][0]}


def _container_port(m: dict[str, dict[str, Any]], service: str, port: int) -> int:
    """The router container port a Service port leads to (named targetPort resolved)."""
    (sp,) = [p for p in m[f"Service/{service}"]["spec"]["ports"] if p["port"] == port]
    named = {p["name"]: p["containerPort"] for p in _router(m)["ports"]}
    return named[sp["targetPort"]] if isinstance(sp["targetPort"], str) else sp["targetPort"]


def _router_args(m: dict[str, dict[str, Any]]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)  # the router's own parser: the rendered command must be one it takes
    cmd = _router(m)["command"]
    assert cmd[:2] == ["pdserve", "router"]
    return p.parse_args(cmd[2:])


def _admin_check(args: argparse.Namespace, local_port: int) -> None:
    """The router's own /metrics gate (Runtime.require_admin) for a keyless request that
    arrived on ``local_port``. A stand-in Runtime (cfg + keys only): the real one needs a
    tokenizer and discovery, which the gate never touches."""
    cfg = RouterConfig(model_dir=args.model, api_keys=("tenant",), admin_port=args.admin_port)
    rt = SimpleNamespace(cfg=cfg, keys=KeyStore(keys=cfg.api_keys))
    scope = {"type": "http", "headers": [], "server": ("10.0.0.5", local_port)}
    Runtime.require_admin(rt, Request(scope))  # type: ignore[arg-type]


def test_operator_scrape_reaches_an_open_metrics_port() -> None:
    """Fails before the fix: the scrape URL led to the router Service's port 80 -> 8080,
    where /metrics answers 401 without a key once apiKeySecret is set."""
    m = _service()
    url = urlsplit(router_metrics_url("", "demo", "ns"))
    assert url.path == "/metrics" and url.hostname is not None
    service, args = url.hostname.split(".")[0], _router_args(m)
    assert url.port is not None and args.api_key_file
    target = _container_port(m, service, url.port)
    _admin_check(args, target)  # opens without a key (before the fix: APIError 401)
    assert target == args.admin_port != args.port
    assert service == "demo-router-admin" and m[f"Service/{service}"]["spec"]["type"] == "ClusterIP"
    with pytest.raises(APIError) as err:  # the public port still refuses (the gate works)
        _admin_check(args, args.port)
    assert err.value.status == 401


def test_prometheus_scrapes_the_admin_port() -> None:
    m = _service()
    router = _router(m)
    assert router["annotations"]["prometheus.io/port"] == str(_router_args(m).admin_port)
    assert {"name": "admin", "containerPort": 8083, "protocol": "TCP"} in router["ports"]
    # Workers keep their one HTTP port (their /metrics has no tenant keys).
    decode = m["Deployment/demo-decode"]["spec"]["template"]["metadata"]["annotations"]
    assert decode["prometheus.io/port"] == "8080"
    # Probes hit /health and /livez, which stay open with keys on: the public port is fine.
    assert {router[k]["httpGet"]["port"] for k in ("readinessProbe", "livenessProbe")} == {"http"}


def test_public_routes_never_reach_the_admin_port() -> None:
    m = _service(serviceType="LoadBalancer", ingress={"host": "llm.example.com"}, httpRoute=ROUTE)
    public = m["Service/demo"]["spec"]
    assert public["type"] == "LoadBalancer"
    assert [p["targetPort"] for p in public["ports"]] == ["http"]  # no admin on the LB
    ing = m["Ingress/demo"]["spec"]["rules"][0]["http"]["paths"]
    assert {str(p["backend"]["service"]) for p in ing} == {
        str({"name": "demo", "port": {"name": "http"}})
    }
    (rule,) = m["HTTPRoute/demo"]["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": "demo", "port": 80}]
    assert _container_port(m, "demo", 80) == _router_args(m).port


def _reaches(rule: dict[str, Any], port: int) -> bool:
    return any(p["port"] == port for p in rule["ports"])


def test_router_pods_admin_port_is_open_only_to_the_operator_and_metrics_namespaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 44: before, no NetworkPolicy selected the router pods, so any pod of any
    namespace reached 8083. Now the public port is open to all, the admin port only to
    the operator's pods (its namespace from the downward API), the service's own router
    pods (per-key budget calls between replicas) and metricsNamespaces."""
    monkeypatch.setenv("PDSERVE_OPERATOR_NAMESPACE", "pdserve-system")
    obj = minimal_llmservice(
        router={"apiKeySecret": KEY}, networkPolicy={"metricsNamespaces": ["monitoring"]}
    )
    m = {f"{c['kind']}/{c['metadata']['name']}": c for c in render(obj)}
    policy = m["NetworkPolicy/demo-router"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {
        "pdserve.io/service": "demo",
        "pdserve.io/role": "router",
    }
    assert policy["policyTypes"] == ["Ingress"]
    args = _router_args(m)
    public = [r for r in policy["ingress"] if _reaches(r, args.port)]
    assert public and all("from" not in r for r in public)  # tenants: through the Ingress
    admin = [r for r in policy["ingress"] if _reaches(r, args.admin_port)]
    assert admin and all(r.get("from") for r in admin)  # never an open "from"
    namespaces = [
        (
            src["namespaceSelector"]["matchExpressions"][0]["values"]
            if "namespaceSelector" in src
            else "its own namespace",
            src.get("podSelector"),
        )
        for r in admin
        for src in r["from"]
    ]
    operator = {
        "matchLabels": {
            "app.kubernetes.io/name": "pdserve",
            "app.kubernetes.io/component": "operator",
        }
    }
    routers = {"matchLabels": policy["podSelector"]["matchLabels"]}  # budget calls
    assert namespaces == [
        (["pdserve-system"], operator),
        ("its own namespace", routers),
        (["monitoring"], None),
    ]
    # picker mode: the picker's gRPC port is the public one, the admin port stays closed
    obj["spec"]["router"]["mode"] = "endpointPicker"
    m = {f"{c['kind']}/{c['metadata']['name']}": c for c in render(obj)}
    rules = m["NetworkPolicy/demo-router"]["spec"]["ingress"]
    assert [r.get("from") is None for r in rules if _reaches(r, 8083)] == [False]
    # off with spec.networkPolicy.enabled: false, like the workers' policy
    obj = minimal_llmservice(networkPolicy={"enabled": False})
    assert not [c for c in render(obj) if c["kind"] == "NetworkPolicy"]


def _prefix_matches(prefix: str, path: str) -> bool:
    """Kubernetes' Prefix / Gateway's PathPrefix: element-wise on "/"."""
    return path == prefix or path.startswith(prefix.rstrip("/") + "/")


def test_lora_admin_routes_are_kept_off_the_ingress_and_route() -> None:
    """Issue 44 item 7: the Ingress and HTTPRoute exposed the whole ``/v1`` prefix, so
    without apiKeySecret anyone on the Internet could load and unload adapters."""
    m = _service(ingress={"host": "llm.example.com"}, httpRoute=ROUTE)
    ing = [p["path"] for p in m["Ingress/demo"]["spec"]["rules"][0]["http"]["paths"]]
    (rule,) = m["HTTPRoute/demo"]["spec"]["rules"]
    route = [x["path"]["value"] for x in rule["matches"]]
    for prefixes in (ing, route):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/metrics"):
            assert not any(_prefix_matches(p, path) for p in prefixes), (path, prefixes)
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models/tiny"):
            assert any(_prefix_matches(p, path) for p in prefixes), (path, prefixes)
