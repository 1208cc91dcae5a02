"""Pure rendering: the pod contract (ports, probes, volumes, security), children, CLI."""

from __future__ import annotations

import pathlib
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_helpers import ROOT, minimal_llmservice, schema_errors

from pdserve.cli import main as pdserve_main
from pdserve.operator.reconcile import keep_autoscaled_replicas
from pdserve.operator.render import render
from pdserve.operator.spec_parse import parse_llmservice
from pdserve.router.discovery.k8s import pool_roles

GPU_EXAMPLE = ROOT / "examples" / "llmservice-gpu.yaml"


def by_key(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in manifests}


def gpu() -> dict[str, dict[str, Any]]:
    with open(GPU_EXAMPLE, encoding="utf-8") as f:
        return by_key(render(yaml.safe_load(f)))


def pod(manifests: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    spec: dict[str, Any] = manifests[f"Deployment/{name}"]["spec"]["template"]["spec"]
    return spec


def test_children_set() -> None:
    keys = set(gpu())
    name = "llama3-8b"
    expected = {
        f"ServiceAccount/{name}-router",
        f"Role/{name}-router",
        f"RoleBinding/{name}-router",
    }
    expected |= {f"ConfigMap/{name}-config", f"Service/{name}", f"Ingress/{name}"}
    expected |= {f"Service/{name}-router-admin"}  # the scrapes' port, never public
    expected |= {f"Service/{name}-{r}" for r in ("prefill", "decode")}
    expected |= {f"Deployment/{name}-{r}" for r in ("router", "prefill", "decode")}
    expected |= {f"PodDisruptionBudget/{name}-{r}" for r in ("router", "prefill", "decode")}
    expected |= {f"NetworkPolicy/{name}-workers", f"NetworkPolicy/{name}-router"}
    assert keys == expected


def test_worker_pods_follow_the_contract() -> None:
    m = gpu()
    for role in ("prefill", "decode"):
        spec = pod(m, f"llama3-8b-{role}")
        c = spec["containers"][0]
        cmd = c["command"]
        assert cmd[:2] == ["pdserve", f"{role}-worker"]
        assert (
            cmd[cmd.index("--port") + 1] == "8080"
            and cmd[cmd.index("--side-channel-port") + 1] == "8082"
        )
        assert cmd[cmd.index("--model") + 1] == "/models/Meta-Llama-3-8B-Instruct"
        assert cmd[cmd.index("--kv-transport") + 1] == "nixl"
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd[cmd.index("--worker-id") + 1] == "$(POD_NAME)"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        for probe in ("livenessProbe", "startupProbe"):  # the process, not its readiness
            assert c[probe]["httpGet"] == {"path": "/livez", "port": "http"}
        mounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
        assert mounts == {"/models": "model", "/tmp": "tmp", "/dev/shm": "dshm"}
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert vols["model"]["persistentVolumeClaim"] == {
            "claimName": "model-weights",
            "readOnly": True,
        }
        annotations = m[f"Deployment/llama3-8b-{role}"]["spec"]["template"]["metadata"][
            "annotations"
        ]
        assert (
            annotations["prometheus.io/scrape"] == "true"
            and annotations["prometheus.io/port"] == "8080"
        )
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    prefill = pod(m, "llama3-8b-prefill")["containers"][0]["command"]
    assert prefill[prefill.index("--kv-events-port") + 1] == "8081"
    assert "--kv-cache-fraction" in prefill and "--max-num-batched-tokens" in prefill
    decode = pod(m, "llama3-8b-decode")
    assert "podAntiAffinity" in decode["affinity"]


def test_router_pd_handoff_from_the_spec() -> None:
    obj = minimal_llmservice("chain", router={"pdHandoff": "decode"})
    cmd = pod(by_key(render(obj)), "chain-router")["containers"][0]["command"]
    assert cmd[cmd.index("--pd-handoff") + 1] == "decode"


def test_router_pod_and_services() -> None:
    m = gpu()
    spec = pod(m, "llama3-8b-router")
    cmd = spec["containers"][0]["command"]
    assert cmd[:2] == ["pdserve", "router"]
    probes = {
        k: spec["containers"][0][k]["httpGet"]["path"]
        for k in ("livenessProbe", "readinessProbe", "startupProbe")
    }
    # A 1-replica decode rollout makes /health 503: that must not restart the router.
    assert probes == {
        "livenessProbe": "/livez",
        "readinessProbe": "/health",
        "startupProbe": "/livez",
    }
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert flags["--discovery"] == "kubernetes" and flags["--service"] == "llama3-8b"
    assert flags["--namespace"] == "llm" and flags["--disagg-threshold"] == "256"
    assert flags["--pd-handoff"] == "router"  # the default; spec.router.pdHandoff: decode
    assert flags["--api-key-file"] == "/etc/pdserve/api-key/api-key"
    assert (
        spec["serviceAccountName"] == "llama3-8b-router"
        and spec["automountServiceAccountToken"] is True
    )
    role = m["Role/llama3-8b-router"]
    for rule in role["rules"]:
        assert rule["verbs"] == ["get", "list", "watch"]
    # EndpointSlices only: the router watches its pool Services' slices, never lists pods.
    assert [(r["apiGroups"], r["resources"]) for r in role["rules"]] == [
        (["discovery.k8s.io"], ["endpointslices"])
    ]
    headless = {
        k.split("/")[1]
        for k, v in m.items()
        if k.startswith("Service/") and v["spec"].get("clusterIP") == "None"
    }
    assert set(pool_roles("llama3-8b")) == headless  # what the router's watch selects
    router_svc = m["Service/llama3-8b"]["spec"]
    assert (
        router_svc["ports"][0]["port"] == 80
        and router_svc["selector"]["pdserve.io/role"] == "router"
    )
    for r in ("prefill", "decode"):
        assert m[f"Service/llama3-8b-{r}"]["spec"]["clusterIP"] == "None"
    ing = m["Ingress/llama3-8b"]["spec"]
    assert ing["tls"] == [{"hosts": ["llama.llm.example.com"], "secretName": "llama-tls"}]
    # Only the OpenAI API is exposed, never the router's /metrics or /workers.
    assert [p["path"] for p in ing["rules"][0]["http"]["paths"]] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/responses",
    ]


def test_ipc_lock_is_an_rdma_opt_in() -> None:
    """IPC_LOCK fails PodSecurity "restricted": only with kvTransfer.ipcLock, never implied."""
    rdma = {"rdmaResourceName": "rdma/hca_shared_devices_a"}
    locked = {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    cases = (
        ({}, {"drop": ["ALL"]}),
        (rdma, {"drop": ["ALL"]}),
        ({**rdma, "ipcLock": True}, locked),
    )
    for kv, caps in cases:
        m = by_key(render(minimal_llmservice(kvTransfer=kv)))
        for role in ("prefill", "decode"):
            assert (
                pod(m, f"demo-{role}")["containers"][0]["securityContext"]["capabilities"] == caps
            )
        assert (
            "add" not in pod(m, "demo-router")["containers"][0]["securityContext"]["capabilities"]
        )


def test_network_policy_admits_only_this_service() -> None:
    policy = gpu()["NetworkPolicy/llama3-8b-workers"]["spec"]
    sel = policy["podSelector"]
    assert sel["matchExpressions"][0]["values"] == ["prefill", "decode"]
    peers, metrics = policy["ingress"]
    assert peers["from"] == [{"podSelector": {"matchLabels": {"pdserve.io/service": "llama3-8b"}}}]
    assert sorted(p["port"] for p in peers["ports"]) == [8080, 8081, 8082, 20000]
    # NIXL's UCX listens only inside its pinned range, and exactly that range is open.
    ucx = next(p for p in peers["ports"] if p["port"] == 20000)
    assert ucx == {"protocol": "TCP", "port": 20000, "endPort": 20031}
    env = gpu()["ConfigMap/llama3-8b-config"]["data"]
    assert env["UCX_TCP_PORT_RANGE"] == "20000-20031"
    tcp = by_key(render(minimal_llmservice(kvTransfer={"transport": "tcp"})))
    assert "UCX_TCP_PORT_RANGE" not in tcp["ConfigMap/demo-config"]["data"]
    assert metrics["ports"] == [{"protocol": "TCP", "port": 8080}]


def test_huggingface_source_uses_init_container() -> None:
    obj = minimal_llmservice(
        model={"source": {"huggingFace": {"id": "org/model", "tokenSecret": {"name": "hf"}}}}
    )
    m = by_key(render(obj))
    worker = pod(m, "demo-prefill")["initContainers"][0]
    assert (
        worker["command"][:3] == ["hf", "download", "org/model"]
        and "--include" not in worker["command"]
    )
    env = {e["name"]: e for e in worker["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    router = pod(m, "demo-router")["initContainers"][0]
    assert "--include" in router["command"]  # the router fetches only tokenizer/config files


def _templates(obj: dict[str, Any]) -> dict[str, Any]:
    m = by_key(render(obj))
    return {
        r: m[f"Deployment/demo-{r}"]["spec"]["template"] for r in ("router", "prefill", "decode")
    }


def test_only_what_pods_read_rolls_pods() -> None:
    base = _templates(minimal_llmservice())
    # No pod reads the SLOs (the planner reads spec): an SLO edit must not roll GPU pods.
    slo = minimal_llmservice(slo={"ttftMs": 250})
    assert _templates(slo) == base
    assert '"ttftMs": 250' in by_key(render(slo))["ConfigMap/demo-config"]["data"]["settings.json"]
    # UCX reads UCX_TLS from the environment: that change must roll the workers.
    ucx = _templates(minimal_llmservice(kvTransfer={"ucxTls": "tcp"}))
    key = "pdserve.io/config-hash"
    for r in ("router", "prefill", "decode"):
        assert ucx[r]["metadata"]["annotations"][key] != base[r]["metadata"]["annotations"][key]


def test_rollouts_surge_first_and_decode_drains() -> None:
    m = by_key(render(minimal_llmservice()))
    for r, grace in (("router", 600), ("prefill", 120), ("decode", 600)):
        dep = m[f"Deployment/demo-{r}"]["spec"]
        assert dep["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}, r
        assert dep["progressDeadlineSeconds"] >= 1800 + 600  # past the startup probe's 30 min
        pod = dep["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        pre = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert pre[0] == "sleep" and 0 < int(pre[1]) < grace  # leave the Endpoints first
    # A budget only where it means something: 1-replica pools (the default) get none.
    assert [k for k in m if k.startswith("PodDisruptionBudget/")] == []
    two = by_key(render(minimal_llmservice(decode={"replicas": 2})))
    assert [k for k in two if k.startswith("PodDisruptionBudget/")] == [
        "PodDisruptionBudget/demo-decode"
    ]


def test_render_is_pure_and_deterministic() -> None:
    obj = minimal_llmservice()
    before = yaml.safe_dump(obj)
    assert render(obj) == render(obj)
    assert yaml.safe_dump(obj) == before


def test_render_cli(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pdserve_main(["render", "-f", str(GPU_EXAMPLE)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert len(docs) == len(gpu()) and all(d["metadata"]["namespace"] == "llm" for d in docs)

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(minimal_llmservice(prefill={"replicas": 9})))
    assert pdserve_main(["render", "-f", str(bad)]) == 1
    assert (
        "spec.prefill.replicas: must lie within [minReplicas, maxReplicas]"
        in capsys.readouterr().err
    )
    assert pdserve_main(["render", "-f", str(tmp_path / "missing.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err
    bad.write_text("kind: Deployment\nmetadata: {name: x}\n")
    assert pdserve_main(["render", "-f", str(bad)]) == 1
    assert "expected LLMService" in capsys.readouterr().err


def test_external_scaling_keeps_the_hpa_replica_count() -> None:
    """With externalScaling an HPA / KEDA drives the pool's Deployment (its scale subresource):
    drift repair keeps the count it finds, clamped to the pool's bounds; other pools do not."""
    obj = minimal_llmservice(decode={"externalScaling": True, "maxReplicas": 6})
    svc = parse_llmservice(obj)
    m = by_key(render(obj))
    decode, prefill = m["Deployment/demo-decode"], m["Deployment/demo-prefill"]
    live = {"spec": {"replicas": 5}}
    assert "replicas" not in keep_autoscaled_replicas(svc, decode, live)["spec"]
    assert keep_autoscaled_replicas(svc, decode, {"spec": {"replicas": 9}})["spec"]["replicas"] == 6
    assert keep_autoscaled_replicas(svc, prefill, live)["spec"]["replicas"] == 1


def test_shared_model_cache_and_ephemeral_storage() -> None:
    hf = {"huggingFace": {"id": "org/model", "revision": "v2", "downloadSizeLimit": "20Gi"}}
    plain = by_key(render(minimal_llmservice(model={"source": hf})))
    # Per-pod download: the emptyDir is requested as ephemeral storage (router: tokenizer only).
    for role, size in (("prefill", "20Gi"), ("decode", "20Gi"), ("router", "1Gi")):
        c = pod(plain, f"demo-{role}")["containers"][0]
        assert c["resources"]["requests"]["ephemeral-storage"] == size, role
    cached_src = {"huggingFace": {**hf["huggingFace"], "cache": {"claimName": "hf-cache"}}}
    cached = by_key(render(minimal_llmservice(model={"source": cached_src})))
    for role in ("prefill", "decode", "router"):
        spec = pod(cached, f"demo-{role}")
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["model"] == {
            "name": "model",
            "persistentVolumeClaim": {"claimName": "hf-cache"},
        }
        init = spec["initContainers"][0]["command"]
        assert init[init.index("--local-dir") + 1] == "/models/org--model@v2"
        main = spec["containers"][0]
        assert {m["mountPath"]: m.get("readOnly") for m in main["volumeMounts"]}["/models"] is True
        assert main["resources"]["requests"]["ephemeral-storage"] == "1Gi"
    cmd = pod(cached, "demo-decode")["containers"][0]["command"]
    assert cmd[cmd.index("--model") + 1] == "/models/org--model@v2"


def test_workers_keep_compiled_code_in_the_shared_cache() -> None:
    """With a shared cache, workers write their compiled code to one folder of it (keyed by
    CPU inside, engine/host_tag.py): a scaled-up pod loads graphs instead of compiling."""
    hf = {"huggingFace": {"id": "org/model", "cache": {"claimName": "hf-cache"}}}
    cached = by_key(render(minimal_llmservice(model={"source": hf})))
    for role in ("prefill", "decode"):
        spec = pod(cached, f"demo-{role}")
        main = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert env["PDSERVE_COMPILE_CACHE"] == "/var/cache/pdserve/inductor"
        assert env["PDSERVE_KERNEL_CACHE"] == "/var/cache/pdserve/kernels"
        mounts = [m for m in main["volumeMounts"] if m["name"] == "model"]
        assert {m["mountPath"]: m.get("readOnly") for m in mounts} == {
            "/models": True,  # the weights stay read-only
            "/var/cache/pdserve": None,
        }
        # One folder per service: another service on the same cache never sees it.
        assert [m["subPath"] for m in mounts if "subPath" in m] == [".pdserve-compiled/demo"]
        made = {c["name"]: c for c in spec["initContainers"]}["compile-cache-dir"]
        assert made["command"] == ["mkdir", "-p", "/models/.pdserve-compiled/demo"]
        assert made["securityContext"]["readOnlyRootFilesystem"] is True
    for manifest in cached.values():  # the two mounts of one volume are valid Kubernetes
        if manifest["kind"] == "Deployment":
            kubernetes_validate.validate(manifest, "1.34", strict=True)
    # The router reads the workers' model seal there (its tokenizer is loaded as sealed,
    # engine/model_seal.py), read-only: no compiled code of its own, no kernel cache.
    router = pod(cached, "demo-router")
    assert "compile-cache-dir" in {c["name"] for c in router["initContainers"]}
    env = {e["name"]: e.get("value") for e in router["containers"][0]["env"]}
    assert env["PDSERVE_COMPILE_CACHE"] == "/var/cache/pdserve/inductor"
    assert "PDSERVE_KERNEL_CACHE" not in env
    mounts = [m for m in router["containers"][0]["volumeMounts"] if m["name"] == "model"]
    assert {m["mountPath"]: m.get("readOnly") for m in mounts} == {
        "/models": True,
        "/var/cache/pdserve": True,
    }
    # In picker mode a decode pod's front reads the same seal, read-only.
    picker = by_key(
        render(minimal_llmservice(model={"source": hf}, router={"mode": "endpointPicker"}))
    )
    front = next(c for c in pod(picker, "demo-decode")["containers"] if c["name"] == "front")
    env = {e["name"]: e.get("value") for e in front["env"]}
    assert env["PDSERVE_COMPILE_CACHE"] == "/var/cache/pdserve/inductor"
    mounts = [m for m in front["volumeMounts"] if m["name"] == "model"]
    assert {m["mountPath"]: m.get("readOnly") for m in mounts} == {
        "/models": True,
        "/var/cache/pdserve": True,
    }
    # Without a shared cache, compiled code stays in the pod's own /tmp.
    plain = by_key(render(minimal_llmservice()))
    main = pod(plain, "demo-decode")["containers"][0]
    assert "PDSERVE_COMPILE_CACHE" not in {e["name"] for e in main["env"]}
    assert all("subPath" not in m for m in main["volumeMounts"])


def test_optional_gateway_api_http_route() -> None:
    route = {
        "parentRefs": [{"name": "public", "namespace": "gateways"}],
        "hostnames": ["llm.example.com"],
    }
    obj = minimal_llmservice(router={"httpRoute": route})
    assert schema_errors(obj) == []
    r = by_key(render(obj))["HTTPRoute/demo"]
    assert r["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert r["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways"}]
    rule = r["spec"]["rules"][0]
    assert [m["path"]["value"] for m in rule["matches"]] == [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/responses",
    ]
    assert rule["backendRefs"] == [{"name": "demo", "port": 80}]
    assert "HTTPRoute/demo" not in by_key(render(minimal_llmservice()))
