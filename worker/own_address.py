"""Whether a call's ``Host`` names this worker (issue 44 item 9).

The router signs the ``Host`` it sends (pdserve/signing.py), so a captured call names
the worker it was meant for. A worker takes a signed call only when that ``Host`` is the
address the connection came in on: an IP literal equal to the socket's local address, or
a name that resolves to it (looked up off the event loop, kept ``TTL_S``), on the local
port. Replayed to another worker of the service within the 30 s window, the call names
the first one and is refused.

Where the ASGI server gives no IP address for the connection (an in-process test client)
there is nothing to compare with and the check passes; uvicorn always gives one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from typing import Any

TTL_S = 30.0
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(text: str) -> Address | None:
    try:
        ip = ipaddress.ip_address(text.strip("[]").split("%")[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket's view of an IPv4 peer
    return mapped or ip


def split_host(host: str) -> tuple[str, int]:
    """``Host``'s name (brackets dropped) and port (80 when absent); port -1 if malformed."""
    if host.startswith("["):  # [v6]:port
        name, _, rest = host[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        name, port = host.split(":")
    else:
        name, port = host, ""
    if not port:
        return name, 80
    return (name, int(port)) if port.isdigit() else (name, -1)


class OwnAddress:
    """``await names_me(host, scope["server"])``; one per worker process."""

    def __init__(self) -> None:
        self._resolved: dict[str, tuple[float, frozenset[Address]]] = {}

    async def names_me(self, host: str, server: Any) -> bool:
        if not server or _ip(str(server[0])) is None:
            return True  # no socket address to compare with (see the module's note)
        local, local_port = _ip(str(server[0])), int(server[1])
        name, port = split_host(host)
        if not name or port != local_port:
            return False
        ip = _ip(name)
        if ip is not None:
            return ip == local
        return local in await self._resolve(name.lower().rstrip("."))

    async def _resolve(self, name: str) -> frozenset[Address]:
        now = time.monotonic()
        hit = self._resolved.get(name)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, None)
        except (OSError, UnicodeError):
            infos = []
        ips = frozenset(ip for info in infos if (ip := _ip(str(info[4][0]))) is not None)
        if len(self._resolved) > 256:
            self._resolved.clear()
        self._resolved[name] = (now + TTL_S, ips)
        return ips
