"""EndpointSlices as the EndpointSlice controller writes them, for the router's tests."""

from __future__ import annotations

from typing import Any

import aiohttp
from k8s_helpers import NS

from pdserve.testing.k8s_emulator import ApiServer

SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"


def ep(
    ip: str, ready: bool | None = True, terminating: bool = False, serving: bool | None = None
) -> dict[str, Any]:
    # A terminating pod that still passes its readiness probe: ready false, serving true.
    serving = ready is not False if serving is None else serving
    cond: dict[str, Any] = {"serving": serving, "terminating": terminating}
    if ready is not None:
        cond["ready"] = ready
    return {"addresses": [ip], "conditions": cond}


def endpoint_slice(name: str, service: str, *endpoints: dict[str, Any], port: int = 8080) -> Any:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": service},
        },
        "ports": [{"name": "side-channel", "port": 8082}, {"name": "http", "port": port}],
        "endpoints": list(endpoints),
    }


class Slices:
    """Writes EndpointSlices as the EndpointSlice controller would (plain REST calls)."""

    def __init__(self, server: ApiServer, session: aiohttp.ClientSession) -> None:
        self.url = str(server.url).rstrip("/") + SLICES
        self.session = session

    async def put(self, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        async with self.session.get(f"{self.url}/{name}") as resp:
            exists = resp.status == 200
        if exists:
            patch = {"endpoints": body["endpoints"]}
            headers = {"Content-Type": "application/merge-patch+json"}
            async with self.session.patch(f"{self.url}/{name}", json=patch, headers=headers) as r:
                assert r.status == 200, await r.text()
        else:
            async with self.session.post(self.url, json=body) as r:
                assert r.status in (200, 201), await r.text()

    async def delete(self, name: str) -> None:
        async with self.session.delete(f"{self.url}/{name}") as r:
            assert r.status == 200, await r.text()
