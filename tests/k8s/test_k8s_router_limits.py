"""``spec.router.limits`` (issue 44 item 6): the tenant limits have CRD fields, the per-key
concurrency cap is on by default, and each limit, given for the whole service, reaches
the router (and, in picker mode, the picker and every decode pod's front) as the flags
the router parses; the routers keep each key's budget whole on one replica of their
Service's ready endpoints (``--budget-peers kubernetes``), which reach each other on the
admin port (the NetworkPolicy lets the service's router pods in) and know their own
address from ``POD_IP``."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import minimal_llmservice, schema_errors
from test_k8s_picker import picker_children, router_args
from test_k8s_router_flags import _router_config

from pdserve.operator.render import render
from pdserve.operator.spec import SpecError


def test_a_service_without_limits_still_caps_each_key() -> None:
    """Before: no field, and the router's default cap is 0 (one key could take every slot)."""
    config = _router_config()
    assert config.max_concurrency_per_key == 64
    assert (config.rate_limit_rpm, config.rate_limit_tpm) == (0, 0)
    assert schema_errors(minimal_llmservice()) == []


def test_limits_are_rendered_once_and_split_by_the_routers() -> None:
    limits = {"requestsPerMinute": 100, "tokensPerMinute": 90_000, "maxConcurrencyPerKey": 8}
    config = _router_config(replicas=3, limits=limits)
    assert (config.rate_limit_rpm, config.rate_limit_tpm) == (100, 90_000)
    assert config.max_concurrency_per_key == 8
    # Exact across the replicas: each key's counters kept by one of the router Service's
    # ready endpoints (router/peer_budgets.py); the operator does not divide them.
    assert config.router_service == "demo"
    assert config.budget_peers == ("kubernetes",) and config.admin_port == 8083
    off = _router_config(limits={"maxConcurrencyPerKey": 0})
    assert off.max_concurrency_per_key == 0  # 0 turns the cap off, by name


def test_picker_mode_carries_the_limits_to_every_front() -> None:
    kids = picker_children(limits={"requestsPerMinute": 60, "maxConcurrencyPerKey": 4})
    pod = kids[("Deployment", "demo-decode")]["spec"]["template"]["spec"]
    (front,) = [c for c in pod["containers"] if c["name"] == "front"]
    args = router_args(front["command"])
    assert (args.rate_limit_rpm, args.max_concurrency_per_key) == (60, 4)
    picker = kids[("Deployment", "demo-router")]["spec"]["template"]["spec"]["containers"][0]
    cmd = picker["command"]
    assert cmd[cmd.index("--rate-limit-rpm") + 1] == "60"


@pytest.mark.parametrize("field", ["requestsPerMinute", "tokensPerMinute", "maxConcurrencyPerKey"])
def test_a_negative_limit_is_refused_by_name(field: str) -> None:
    obj: dict[str, Any] = minimal_llmservice(router={"limits": {field: -1}})
    assert any(f"router.limits.{field}" in e for e in schema_errors(obj))
    with pytest.raises(SpecError, match=rf"^spec.router.limits.{field}: must be >= 0"):
        render(obj)


def test_router_replicas_reach_each_other_for_the_budgets() -> None:
    """--budget-peers kubernetes needs the pod's address (the downward API's POD_IP) and
    the admin port open to the service's own router pods, and nobody else's."""
    obj = minimal_llmservice(router={"replicas": 3})
    kids = {(m["kind"], m["metadata"]["name"]): m for m in render(obj)}
    router = kids[("Deployment", "demo-router")]["spec"]["template"]
    (c,) = router["spec"]["containers"]
    assert c["command"][c["command"].index("--budget-peers") + 1] == "kubernetes"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    policy = kids[("NetworkPolicy", "demo-router")]["spec"]
    (admin,) = [r for r in policy["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 8083}]]
    own = [s for s in admin["from"] if "namespaceSelector" not in s]
    assert own == [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}]
    front = next(
        c
        for c in render(minimal_llmservice(router={"mode": "endpointPicker"}))
        if c["kind"] == "Deployment" and c["metadata"]["name"] == "demo-decode"
    )["spec"]["template"]["spec"]["containers"]
    assert all("--budget-peers" not in c["command"] for c in front)  # a front is one pod
