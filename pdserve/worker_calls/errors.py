"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

The router answers its clients with them (router/errors.py turns one into a response),
and a worker's refusal of a call comes back as one (:func:`from_worker_body`), to the
router or to the decode worker's prefill chain alike.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def from_worker_body(status: int, body: Any, default: str) -> APIError:
    """An error answered by a worker, passed on with its message and param."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return APIError(
            status, str(err.get("message") or default), err.get("param"), err.get("code")
        )
    return APIError(status, default)
