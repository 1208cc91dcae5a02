"""Kubernetes endpoint listing, URL handling and the router's command line."""

from __future__ import annotations

import argparse
from datetime import datetime, timezone

import pytest
from kubernetes.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodList, V1PodStatus

from pdserve.router.discovery import events_address, normalize_url
from pdserve.router.discovery_k8s import KubernetesSource, endpoints_from_pods
from pdserve.router.main import add_arguments, build_config, build_source


def pod(name: str, role: str, ip: str, ready: bool = True, deleting: bool = False) -> V1Pod:
    labels = {"pdserve.io/service": "llm", "pdserve.io/role": role}
    gone = datetime.now(timezone.utc) if deleting else None
    meta = V1ObjectMeta(name=name, labels=labels, deletion_timestamp=gone)
    cond = V1PodCondition(type="Ready", status="True" if ready else "False")
    return V1Pod(metadata=meta, status=V1PodStatus(phase="Running", pod_ip=ip, conditions=[cond]))


def test_endpoints_from_ready_pods_only() -> None:
    pods = [pod("a", "prefill", "10.0.0.1"), pod("b", "decode", "10.0.0.2"),
            pod("c", "decode", "10.0.0.3", ready=False), pod("d", "router", "10.0.0.4"),
            pod("e", "prefill", "10.0.0.5", deleting=True)]  # fmt: skip
    eps = endpoints_from_pods(pods)
    assert [(e.role, e.url) for e in eps] == [
        ("decode", "http://10.0.0.2:8080"),
        ("prefill", "http://10.0.0.1:8080"),
    ]


async def test_kubernetes_source_lists_by_label_selector() -> None:
    class CoreV1:  # stands in for kubernetes.client.CoreV1Api: no API server here
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def list_namespaced_pod(self, namespace: str, label_selector: str) -> V1PodList:
            self.calls.append((namespace, label_selector))
            return V1PodList(items=[pod("a", "decode", "10.1.1.1")])

    api = CoreV1()
    src = KubernetesSource("llm", "ns1", core_api=api)
    eps = await src.list()
    assert [e.url for e in eps] == ["http://10.1.1.1:8080"]
    assert api.calls == [("ns1", "pdserve.io/service=llm,pdserve.io/role in (prefill,decode)")]
    with pytest.raises(ValueError, match="--service"):
        KubernetesSource("", "ns")


@pytest.mark.parametrize(
    ("url", "want"),
    [("127.0.0.1:8100", "http://127.0.0.1:8100"), ("http://h:1/", "http://h:1")],
)
def test_normalize_url(url: str, want: str) -> None:
    assert normalize_url(url) == want


def test_bad_url_is_refused() -> None:
    with pytest.raises(ValueError, match="bad worker URL"):
        normalize_url("ftp://x")


def test_wildcard_events_address_uses_worker_host() -> None:
    assert events_address("http://10.0.0.7:8080", "tcp://0.0.0.0:8081") == "tcp://10.0.0.7:8081"
    assert events_address("http://a:1", "tcp://b:2") == "tcp://b:2"
    assert events_address("http://a:1", "") == ""


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_config_and_api_keys(tmp_path, monkeypatch) -> None:
    args = _parse("--model", "/m", "--decode", "h:1", "--prefill", "h:2", "--prefill", "h:3",
                  "--routing", "round-robin", "--disagg-threshold", "99",
                  "--max-queue", "7")  # fmt: skip
    cfg = build_config(args)
    assert (cfg.routing, cfg.disagg_threshold, cfg.max_queue, cfg.api_keys) == (
        "round-robin", 99, 7, ())  # fmt: skip
    assert args.prefill == ["h:2", "h:3"]
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert build_config(args).api_keys == ("from-env",)
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nk1\n\nk2\n")
    assert build_config(_parse("--model", "/m", "--api-key-file", str(keyfile))).api_keys == (
        "k1", "k2")  # fmt: skip
    with pytest.raises(SystemExit, match="--decode"):
        build_source(_parse("--model", "/m"))
    with pytest.raises(SystemExit, match="cannot read"):
        build_config(_parse("--model", "/m", "--api-key-file", str(tmp_path / "missing")))


def test_scorers_are_name_weight_pairs_and_round_robin_is_a_picker() -> None:
    cfg = build_config(_parse("--model", "/m", "--scorer", "prefix=2", "--scorer", "load=1"))
    assert [(s.name, s.weight) for s in cfg.prefill_scorers] == [
        ("prefix-match", 2.0), ("queued-tokens", 1.0), ("running", 1.0)]  # fmt: skip
    assert cfg.picker == "max-score" and cfg.uses_prefix
    cfg = build_config(_parse("--model", "/m", "--scorer", "running=3", "--decode-scorer", "kv=2"))
    assert [(s.name, s.weight) for s in cfg.decode_scorers] == [("free-kv", 2.0)]
    assert not cfg.uses_prefix  # no prefix scorer: no block hashes, no index lookups
    # The older flags still work: --routing round-robin picks the round-robin picker, and
    # --prefix-weight is --scorer prefix=W on top of the defaults.
    cfg = build_config(_parse("--model", "/m", "--routing", "round-robin"))
    assert cfg.picker == "round-robin" and not cfg.uses_prefix
    assert build_config(_parse("--model", "/m", "--picker", "round-robin")).picker == "round-robin"
    cfg = build_config(_parse("--model", "/m", "--prefix-weight", "5"))
    assert ("prefix-match", 5.0) in [(s.name, s.weight) for s in cfg.prefill_scorers]
    with pytest.raises(ValueError, match=r"unknown scorer .typo.; valid: .*or a group"):
        build_config(_parse("--model", "/m", "--scorer", "typo=1"))
    with pytest.raises(SystemExit):
        _parse("--model", "/m", "--scorer", "prefix")  # no weight: argparse refuses it
