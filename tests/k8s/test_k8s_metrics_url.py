"""spec.autoscaling.metricsUrl is fetched by the operator, from its own pod: only http(s)
to a host that is not the cloud's metadata service, link-local, loopback or unspecified
(operator/url_checks.py). Each refused URL here was accepted before the check."""

from __future__ import annotations

import pytest
from k8s_helpers import minimal_llmservice

from pdserve.operator import url_checks
from pdserve.operator.render import render
from pdserve.operator.spec import SpecError

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
    ["http://prometheus-operated.monitoring:9090", "https://prom.example.com/api/prom",
     "http://10.0.0.7:9090"],
)  # fmt: skip
def test_ordinary_prometheus_urls_pass(url: str) -> None:
    render(minimal_llmservice(autoscaling={"metricsUrl": url}))


def test_a_name_is_checked_again_by_what_it_resolves_to() -> None:
    """A name can point anywhere: the fetch refuses one that resolves to loopback."""
    url_checks.check_url("spec.autoscaling.metricsUrl", "http://localhost:9090")  # a name
    assert "loopback" in url_checks.resolved_problem("http://localhost:9090")
