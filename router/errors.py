"""The router's OpenAI-style errors: :class:`APIError` (pdserve/worker_calls/errors.py,
where the worker calls raise it too) and the response that answers a client with one."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pdserve.worker_calls.errors import APIError as APIError
from pdserve.worker_calls.errors import from_worker_body as from_worker_body


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
