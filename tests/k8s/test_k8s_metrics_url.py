"""spec.autoscaling.metricsUrl is fetched by the operator, from its own pod: only http(s)
to a host that is not the cloud's metadata service, link-local, loopback or unspecified
(operator/url_checks.py). Each refused URL here was accepted before the check."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from k8s_helpers import minimal_llmservice

from pdserve.operator import url_checks
from pdserve.operator.autoscale_inputs import InputError, prometheus_snapshot
from pdserve.operator.render import render
from pdserve.operator.spec import SpecError
from pdserve.operator.spec_parse import parse_llmservice
from pdserve.planner.config import SLO
from pdserve.planner.snapshot import PoolStatus

REFUSED = [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://169.254.170.2/v2/credentials",  # ECS task credentials: link-local too
    "http://[fe80::1]/",
    "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://127.0.0.1:8080/healthz",
    "http://0.0.0.0:9090",
    "file:///etc/passwd",
    "gopher://prometheus:9090",
    "http://user:pw@prometheus:9090",
    "http:///api",
]


@pytest.mark.parametrize("url", REFUSED)
def test_refused_metrics_url_names_the_field(url: str) -> None:
    obj = minimal_llmservice(autoscaling={"metricsUrl": url})
    with pytest.raises(SpecError, match=r"^spec.autoscaling.metricsUrl: "):
        render(obj)


@pytest.mark.parametrize(
    "url",
    [
        "http://prometheus-operated.monitoring:9090",
        "https://prom.example.com/api/prom",
        "http://10.0.0.7:9090",
    ],
)
def test_ordinary_prometheus_urls_pass(url: str) -> None:
    render(minimal_llmservice(autoscaling={"metricsUrl": url}))


def test_a_name_is_checked_again_by_what_it_resolves_to() -> None:
    """A name can point anywhere: the fetch refuses one that resolves to loopback."""
    url_checks.check_url("spec.autoscaling.metricsUrl", "http://localhost:9090")  # a name
    assert "loopback" in url_checks.resolved_problem("http://localhost:9090")


class _FakePrometheus(http.server.BaseHTTPRequestHandler):
    """Answers every instant query with an empty vector, or (``secret``) a 500 whose body
    an SSRF would want to read back through status and Events."""

    secret = ""
    hosts: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).hosts.append(self.headers.get("Host", ""))
        if self.secret:
            body, code = self.secret.encode(), 500
        else:
            body, code = b'{"status":"success","data":{"resultType":"vector","result":[]}}', 200
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakePrometheus.secret, _FakePrometheus.hosts = "", []
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _rebinding_dns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """prom.test resolves to the test's server (127.0.0.1, let through for the test: the
    stand-in for an allowed Prometheus) once, then to the metadata service."""
    calls: list[str] = []
    real = socket.getaddrinfo

    def rebinding(host: Any, *args: Any, **kw: Any) -> Any:
        if host != "prom.test":
            return real(host, *args, **kw)
        calls.append(host)
        ip = "127.0.0.1" if len(calls) == 1 else "169.254.169.254"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(
        url_checks, "forbidden_address", lambda ip: "link-local" if ip.is_link_local else ""
    )
    return calls


def _svc(port: int) -> Any:
    obj = minimal_llmservice(
        autoscaling={"enabled": True, "metricsUrl": f"http://prom.test:{port}"}
    )
    return parse_llmservice(obj, "default")


async def test_the_fetch_connects_to_the_address_that_was_checked(
    monkeypatch: pytest.MonkeyPatch, prometheus: int
) -> None:
    """Issue 44 item 8: the name was resolved to check it, then again to connect (a DNS
    rebinding answers the second with 169.254.169.254). Now once: every query of the
    snapshot goes to the checked address, the name in the Host header."""
    calls = _rebinding_dns(monkeypatch)
    pools = (PoolStatus(1, 1), PoolStatus(1, 1))
    with contextlib.suppress(InputError):  # empty series: the snapshot may find no rates
        await prometheus_snapshot(_svc(prometheus), time.time(), pools, SLO(1.0, 0.1))
    assert calls == ["prom.test"]
    assert _FakePrometheus.hosts and set(_FakePrometheus.hosts) == {f"prom.test:{prometheus}"}


async def test_reply_bodies_never_reach_status_and_an_allowlist_holds(
    monkeypatch: pytest.MonkeyPatch, prometheus: int
) -> None:
    _rebinding_dns(monkeypatch)
    _FakePrometheus.secret = '{"status": "error", "error": "AKIA-SECRET-CREDENTIALS"}'
    pools = (PoolStatus(1, 1), PoolStatus(1, 1))
    with pytest.raises(InputError) as err:
        await prometheus_snapshot(_svc(prometheus), time.time(), pools, SLO(1.0, 0.1))
    assert "SECRET" not in str(err.value) and "HTTP 500" in str(err.value)
    with pytest.raises(ValueError, match="outside --metrics-url-allow"):
        url_checks.pin("http://10.1.2.3:9090", allow=("192.168.0.0/16",))
    assert url_checks.pin("http://10.1.2.3:9090", allow=("10.0.0.0/8",)) == "10.1.2.3"
