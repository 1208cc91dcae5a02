"""What an engine hands its callers: one output delta per request per step, and the
failures a caller tells apart (one request's fault, a dead engine).

Torch-free: the worker front ends build their replies from these without importing the
engine (:mod:`pdserve.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

HANDOFF = "handoff"  # finish_reason of a prefill-mode request whose KV is held for decode


class RequestFailed(Exception):
    """This request (not the worker) failed: its own state could not be built or stepped.

    Workers answer it as a request fault (HTTP 422, code ``request_failed``), which the
    router passes to its client and never retries on another worker.
    """


REQUEST_FAILED = "request_failed"  # RequestOutput.error_code of a per-request fault


class EngineDeadError(RuntimeError):
    """The engine (its thread or its core process) has stopped; no request can be served."""


@dataclass(frozen=True)
class RequestOutput:
    """A delta for one request: what happened since the previous output."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str = ""
    error_code: str = ""  # REQUEST_FAILED when this request alone failed (see RequestFailed)
    kv_block_ids: list[int] | None = None  # prefill mode: the held blocks, on finish
    kv_block_hashes: list[int] | None = None  # prefill mode: hashes of the full prompt blocks
    kv_handle: Any = None  # prefill mode: what the KV holder returned for the held blocks
    queue_seconds: float | None = None  # arrival to first schedule, on the first output
    # One (logprob, top [(id, logprob)]) per token id, when the request asked for logprobs.
    logprobs: list[Any] | None = None
    # On the first output of a request that asked: per prompt token [logprob, rank, top],
    # the first None (engine/prompt_logprobs.py).
    prompt_logprobs: list[Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "cached_tokens": self.num_cached_tokens,
        }

    def then(self, later: RequestOutput) -> RequestOutput:
        """This delta and the ``later`` one of the same request as a single delta.

        A stream consumer that fell behind the engine sends one message for all the
        steps it missed instead of one per token.
        """
        assert later.request_id == self.request_id and not self.finished
        return replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=_joined(self.logprobs, later.logprobs),
            prompt_logprobs=self.prompt_logprobs
            if self.prompt_logprobs is not None
            else later.prompt_logprobs,
            queue_seconds=self.queue_seconds
            if self.queue_seconds is not None
            else later.queue_seconds,
        )


def _joined(a: list[Any] | None, b: list[Any] | None) -> list[Any] | None:
    if a is None and b is None:
        return None
    return (a or []) + (b or [])
