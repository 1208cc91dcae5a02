"""``spec.kvCache.tiers``: the schema takes it, every worker gets the tier flags, the disk
volume and the store's password, and the operator runs a Redis Deployment + Service for the
shared tier unless an existing store's address is given (pure rendering)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from k8s_helpers import minimal_llmservice, schema_errors

from pdserve.operator.render import optional_children, render
from pdserve.operator.spec import SpecError

TIERS = {
    "hostBytes": 1 << 30,
    "diskBytes": 8 << 30,
    "diskPath": "/kv",
    "shared": {"enabled": True, "passwordSecret": {"name": "kv-pass"}, "maxMemory": "2gb"},
}


def _render(tiers: dict[str, Any]) -> dict[str, dict[str, Any]]:
    obj = minimal_llmservice(kvCache={"tiers": tiers})
    assert schema_errors(obj) == []
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in render(obj)}


def _container(m: dict[str, dict[str, Any]], role: str) -> dict[str, Any]:
    c: dict[str, Any] = m[f"Deployment/demo-{role}"]["spec"]["template"]["spec"]["containers"][0]
    return c


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_get_the_tiers_and_the_operator_runs_the_store(role: str) -> None:
    m = _render(TIERS)
    cmd = " ".join(_container(m, role)["command"] + _container(m, role).get("args", []))
    assert "--kv-tier-host-bytes 1073741824" in cmd
    assert "--kv-tier-disk-path /kv --kv-tier-disk-bytes 8589934592" in cmd
    assert "--kv-tier-shared-url redis://demo-kv-store.default.svc:6379/0" in cmd
    pod = m[f"Deployment/demo-{role}"]["spec"]["template"]["spec"]
    disk = next(v for v in pod["volumes"] if v["name"] == "kv-tier-disk")
    assert disk["emptyDir"] == {"sizeLimit": str(8 << 30)}
    assert {"name": "kv-tier-disk", "mountPath": "/kv"} in _container(m, role)["volumeMounts"]
    env = {e["name"]: e for e in _container(m, role)["env"]}
    ref = env["PDSERVE_KV_SHARED_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kv-pass", "key": "password"}
    store = m["Deployment/demo-kv-store"]["spec"]["template"]["spec"]["containers"][0]
    assert store["args"][store["args"].index("--maxmemory") + 1] == "2gb"
    assert "allkeys-lru" in store["args"] and "--requirepass" in store["args"]
    assert m["Service/demo-kv-store"]["spec"]["ports"][0]["port"] == 6379
    for key in ("Deployment/demo-kv-store", "Service/demo-kv-store", f"Deployment/demo-{role}"):
        kubernetes_validate.validate(m[key], "1.34", strict=True)
    assert ("apps/v1", "Deployment", "demo-kv-store") in optional_children("demo")


def test_an_existing_store_is_used_as_given() -> None:
    m = _render({"shared": {"enabled": True, "address": "redis.cache:6379"}})
    assert "Deployment/demo-kv-store" not in m
    cmd = _container(m, "prefill")["command"]
    assert cmd[cmd.index("--kv-tier-shared-url") + 1] == "redis://redis.cache:6379/0"


def test_no_tiers_renders_nothing_new() -> None:
    m = {f"{x['kind']}/{x['metadata']['name']}": x for x in render(minimal_llmservice())}
    assert "--kv-tier" not in " ".join(_container(m, "prefill")["command"])
    assert "Deployment/demo-kv-store" not in m


@pytest.mark.parametrize(
    ("tiers", "field"),
    [
        ({"shared": {"enabled": True}}, "spec.kvCache.tiers.shared.passwordSecret.name"),
        ({"diskBytes": 1 << 30, "diskPath": "kv"}, "spec.kvCache.tiers.diskPath"),
        ({"hostBytes": -1}, "spec.kvCache.tiers.hostBytes"),
    ],
)
def test_bad_tiers_are_refused_by_name(tiers: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        render(minimal_llmservice(kvCache={"tiers": tiers}))
