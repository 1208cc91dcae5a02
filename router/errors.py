"""The router's OpenAI-style errors: :class:`APIError` (pdserve/worker_calls/errors.py,
where the worker calls raise it too) and the response that answers a client with one."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pdserve.worker_calls.errors import APIError as APIError
from pdserve.worker_calls.errors import from_worker_body as from_worker_body


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_later(status: int, message: str, code: str, after_s: int = 1) -> APIError:
    """A refusal the client may send again in ``after_s`` seconds (its Retry-After header):
    a full queue, a limit reached, a budget moving between replicas."""
    return APIError(status, message, code=code, headers={"Retry-After": str(after_s)})


def response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
