"""URLs an LLMService makes the operator fetch (``spec.autoscaling.metricsUrl``).

The operator fetches them from its own pod, with its own network reach: a URL pointing
at the cloud's metadata service (169.254.169.254, fd00:ec2::254) would hand an
LLMService author the node's cloud credentials through the operator (the replies end up
in status and events), and other link-local, loopback or unspecified addresses reach
what only the operator's pod should reach. So: http or https, a host, none of those
addresses, by literal and again by what the name resolves to when it is fetched.

At fetch time the name is resolved once (``pin``), every address checked (and, where the
cluster admin gave an allowlist, ``--metrics-url-allow CIDR``, required to lie in it),
and the connection goes to that checked address (``pinned_client``: the URL's name
stays in the Host header and TLS's SNI and certificate check), never through a second
resolution that a rebinding DNS could answer differently. Redirects are not followed,
and what the server answered never goes into status or Events (only its HTTP status).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import httpx

from pdserve.operator.spec import SpecError

METADATA_HOSTS = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
    }
)
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def forbidden_address(ip: IP) -> str:
    """Why the operator must not fetch from ``ip`` ("" if it may)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return forbidden_address(ip.ipv4_mapped)
    if ip.is_link_local:
        return "a link-local address (cloud metadata services live there)"
    if ip == ipaddress.ip_address("fd00:ec2::254"):
        return "the EC2 metadata service's IPv6 address"
    if ip.is_loopback:
        return "a loopback address (the operator's own pod)"
    if ip.is_unspecified or ip.is_multicast:
        return "not a host address"
    return ""


def check_url(path: str, url: str) -> None:
    """Raise SpecError naming ``path`` if ``url`` is not one the operator may fetch."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as exc:
        raise SpecError(path, f"is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise SpecError(path, f"must be an http or https URL, got scheme {parts.scheme!r}")
    if not host:
        raise SpecError(path, "has no host")
    if parts.username is not None or parts.password is not None:
        raise SpecError(path, "must not carry credentials")
    if host.rstrip(".").lower() in METADATA_HOSTS:
        raise SpecError(path, f"{host!r} is a cloud metadata service")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return  # a name: checked again when it is fetched (resolved_problem)
    why = forbidden_address(ip)
    if why:
        raise SpecError(path, f"{host} is {why}")


def resolved_problem(url: str) -> str:
    """At fetch time: "" or why the URL's host resolves to a forbidden address."""
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return f"cannot resolve {host}: {exc}"
    for info in infos:
        why = forbidden_address(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
        if why:
            return f"{host} resolves to {info[4][0]}, {why}"
    return ""


def _allowed(ip: IP, allow: Sequence[str]) -> bool:
    return any(ip in ipaddress.ip_network(cidr, strict=False) for cidr in allow)


def pin(url: str, allow: Sequence[str] = ()) -> str:
    """The one address the fetch of ``url`` connects to: its host resolved once, every
    address checked; ValueError saying why not (no reply content: nothing was fetched)."""
    host = urlsplit(url).hostname or ""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise ValueError(f"cannot resolve {host}: {exc}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for ip in addresses:
        why = forbidden_address(ip)
        if why:
            raise ValueError(f"{host} resolves to {ip}, {why}")
        if allow and not _allowed(ip, allow):
            raise ValueError(f"{host} resolves to {ip}, outside --metrics-url-allow")
    if not addresses:
        raise ValueError(f"cannot resolve {host}")
    return str(addresses[0])


class PinnedTransport(httpx.HTTPTransport):
    """Connects to ``ip`` whatever the request's host name; the name stays in the Host
    header and is what TLS sends (SNI) and checks the certificate against."""

    def __init__(self, ip: str, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.ip = ip

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host
        request.url = request.url.copy_with(host=self.ip)
        request.extensions = {**request.extensions, "sni_hostname": name}
        return super().handle_request(request)


def pinned_client(url: str, allow: Sequence[str] = (), timeout_s: float = 5.0) -> httpx.Client:
    """An httpx client for ``url`` that connects only to the address ``pin`` checked."""
    return httpx.Client(
        transport=PinnedTransport(pin(url, allow)), timeout=timeout_s, follow_redirects=False
    )
