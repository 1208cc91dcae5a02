"""The children API client follows expiring credentials (bound service-account tokens).

A tiny aiohttp server stands in for the API server and accepts only the current token;
the "kubelet" rotates the token file. The client logs in again on its refresh period and,
when the old token is refused first (401), once more at once.
"""

from __future__ import annotations

import pathlib
from typing import Any

import aiohttp.web
import kopf
import pytest
from aiohttp.test_utils import TestServer

from pdserve.operator.kube import KubeClient

pytestmark = pytest.mark.timeout(30)


async def test_client_relogs_in_when_the_token_rotates(tmp_path: pathlib.Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    accepted = {"token": "token-1"}
    seen: list[str] = []

    async def handler(request: aiohttp.web.Request) -> aiohttp.web.Response:
        auth = request.headers.get("Authorization", "")
        seen.append(auth)
        if auth != f"Bearer {accepted['token']}":
            return aiohttp.web.json_response({"message": "Unauthorized"}, status=401)
        return aiohttp.web.json_response({"kind": "ConfigMap", "metadata": {"name": "x"}})

    app = aiohttp.web.Application()
    app.router.add_get("/api/v1/namespaces/default/configmaps/x", handler)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, scheme="Bearer", token=token_file.read_text())

        client = KubeClient(login(), login_fn=login, refresh_s=3600)
        try:
            assert (await client.get("v1", "ConfigMap", "default", "x")) is not None
            # The kubelet rotates the token; the API server stops accepting the old one.
            token_file.write_text("token-2")
            accepted["token"] = "token-2"
            assert (await client.get("v1", "ConfigMap", "default", "x")) is not None
            assert seen[-2:] == ["Bearer token-1", "Bearer token-2"]  # 401, login, retry
            assert client.logins == 2
            # The periodic refresh picks up a rotated token before any 401.
            client.refresh_s = 0.0
            token_file.write_text("token-3")
            accepted["token"] = "token-3"
            assert (await client.get("v1", "ConfigMap", "default", "x")) is not None
            assert seen[-1] == "Bearer token-3" and client.logins == 3
        finally:
            await client.close()
