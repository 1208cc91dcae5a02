"""Kubernetes endpoints from EndpointSlices, URL handling and the router's command line."""

from __future__ import annotations

import argparse

import pytest

from pdserve.router.api_keys import KeyStore
from pdserve.router.discovery.k8s import KubernetesSource, endpoints_from_slices, pool_roles
from pdserve.router.discovery.workers import events_address, normalize_url
from pdserve.router.main import add_arguments, build_config, build_source

pytestmark = pytest.mark.unit


def slice_(
    service: str, *endpoints: tuple[str, dict[str, bool]], port: int = 8080, family: str = "IPv4"
) -> dict:
    return {
        "metadata": {"labels": {"kubernetes.io/service-name": service}},
        "addressType": family,
        "ports": [{"name": "http", "port": port}],
        "endpoints": [{"addresses": [ip], "conditions": c} for ip, c in endpoints],
    }


def test_endpoints_from_slices_by_conditions() -> None:
    roles = pool_roles("llm")
    assert roles == {"llm-prefill": "prefill", "llm-decode": "decode"}
    slices = [
        slice_(
            "llm-decode",
            ("10.0.0.2", {"ready": True}),
            ("10.0.0.3", {"ready": False}),
            ("10.0.0.6", {"ready": False, "serving": True, "terminating": True}),
            ("10.0.0.7", {}),
        ),  # nil ready: the API says to treat it as ready
        slice_("llm-prefill", ("10.0.0.1", {"ready": True}), port=9000),
        slice_("llm-decode", ("10.0.0.2", {"ready": True})),  # the same pod in two slices
        slice_("llm", ("10.0.0.4", {"ready": True})),  # the router's own Service
        slice_("llm-decode", ("fd00::5", {"ready": True}), family="IPv6"),
    ]
    assert [(e.role, e.url) for e in endpoints_from_slices(slices, roles)] == [
        ("decode", "http://10.0.0.2:8080"),
        ("decode", "http://10.0.0.7:8080"),
        ("decode", "http://[fd00::5]:8080"),
        ("prefill", "http://10.0.0.1:9000"),
    ]


def test_kubernetes_source_selects_the_pool_services() -> None:
    src = KubernetesSource("llm", "ns1")
    assert src.selector == "kubernetes.io/service-name in (llm-decode,llm-prefill)"
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
    args = _parse(
        "--model",
        "/m",
        "--decode",
        "h:1",
        "--prefill",
        "h:2",
        "--prefill",
        "h:3",
        "--picker",
        "round-robin",
        "--disagg-threshold",
        "99",
        "--max-queue",
        "7",
    )
    cfg = build_config(args)
    assert (cfg.picker, cfg.disagg_threshold, cfg.max_queue, cfg.api_keys) == (
        "round-robin",
        99,
        7,
        (),
    )
    assert args.prefill == ["h:2", "h:3"]
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert build_config(args).api_keys == ("from-env",)
    keyfile = tmp_path / "keys"
    keyfile.write_text("# comment\nk1\n\nk2\n")
    cfg = build_config(_parse("--model", "/m", "--api-key-file", str(keyfile)))
    assert cfg.api_key_file == str(keyfile)  # read (and re-read) by the router's KeyStore
    assert KeyStore(cfg.api_keys, cfg.api_key_file).tenant_keys() == {"k1": 0, "k2": 0}
    with pytest.raises(SystemExit, match="--decode"):
        build_source(_parse("--model", "/m"))
    with pytest.raises(SystemExit, match="cannot read"):
        build_config(_parse("--model", "/m", "--api-key-file", str(tmp_path / "missing")))


def test_scorers_are_name_weight_pairs_and_round_robin_is_a_picker() -> None:
    cfg = build_config(_parse("--model", "/m", "--scorer", "prefix=2", "--scorer", "load=1"))
    assert [(s.name, s.weight) for s in cfg.prefill_scorers] == [
        ("prefix-match", 2.0),
        ("queued-tokens", 1.0),
        ("running", 1.0),
    ]
    assert cfg.picker == "max-score" and cfg.uses_prefix
    cfg = build_config(_parse("--model", "/m", "--scorer", "running=3", "--decode-scorer", "kv=2"))
    assert [(s.name, s.weight) for s in cfg.decode_scorers] == [("free-kv", 2.0)]
    assert not cfg.uses_prefix  # no prefix scorer: no block hashes, no index lookups
    cfg = build_config(_parse("--model", "/m", "--picker", "round-robin"))
    assert cfg.picker == "round-robin" and not cfg.uses_prefix
    for retired in ("--routing", "--prefix-weight", "--load-weight", "--balance-weight"):
        with pytest.raises(SystemExit):  # the older forms are gone: argparse names them
            _parse("--model", "/m", retired, "1")
    with pytest.raises(ValueError, match=r"unknown scorer .typo.; valid: .*or a group"):
        build_config(_parse("--model", "/m", "--scorer", "typo=1"))
    with pytest.raises(SystemExit):
        _parse("--model", "/m", "--scorer", "prefix")  # no weight: argparse refuses it


def test_in_cluster_token_is_read_again_as_the_kubelet_rotates_it(tmp_path, monkeypatch) -> None:
    """Bound service-account tokens expire: the router re-reads the projected token file."""
    from pdserve.router.discovery import kube_api

    token = tmp_path / "token"
    token.write_text("first\n")
    access = kube_api.ApiAccess("https://k8s:443", token_file=str(token))
    assert access.headers()["Authorization"] == "Bearer first"
    token.write_text("second\n")
    assert access.headers()["Authorization"] == "Bearer first"  # cached for TOKEN_TTL_S
    monkeypatch.setattr(kube_api, "TOKEN_TTL_S", 0.0)
    assert access.headers()["Authorization"] == "Bearer second"
    assert access.headers()["User-Agent"] == "pdserve-router"
