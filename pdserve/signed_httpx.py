"""Signed calls to a worker from httpx (tools, tests, ``pdserve up``'s own checks): the
same signature the router's aiohttp session adds (pdserve/signing.py)."""

from __future__ import annotations

from collections.abc import Generator

import httpx

from pdserve import keys, signing


class SignedAuth(httpx.Auth):
    """``httpx.Client(auth=SignedAuth(secret))``: each call signed with the service secret;
    ``check_proof`` also refuses a reply that does not prove it (httpx.HTTPError)."""

    requires_request_body = True

    def __init__(self, secret: str | tuple[str, ...], check_proof: bool = True) -> None:
        self.ring = keys.KeyRing(keys.HTTP, secret)
        self.check_proof = check_proof

    def __call__(self, request: httpx.Request) -> httpx.Request:
        """As a plain callable (clients that take any callable as auth, such as Starlette's
        TestClient): signs, without checking the reply."""
        self._sign(request)
        return request

    def _sign(self, request: httpx.Request) -> str:
        host = request.headers.get("Host", "")
        auth = signing.sign(
            self.ring, request.method, request.url.raw_path.decode(), request.content, host=host
        )
        request.headers[signing.HEADER] = auth
        return auth

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        auth = self._sign(request)
        response = yield request
        proof = response.headers.get(signing.PROOF_HEADER)
        if (
            self.check_proof
            and response.status_code < 400
            and not signing.proof_ok(self.ring, auth, proof)
        ):
            raise httpx.HTTPError(f"{request.url}: the reply does not prove the service secret")
