"""One object per request, owned by the scheduler.

``num_computed_tokens`` catches up with ``all_token_ids``: a prompt chunk, a
decode step and a recompute after preemption are the same operation. Waiting
for remote KV is one more state.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.engine.sampling_params import SamplingParams


class RequestFailed(Exception):
    """This request (not the worker) failed: its own state could not be built or stepped.

    Workers answer it as a request fault (HTTP 422, code ``request_failed``), which the
    router passes to its client and never retries on another worker.
    """


REQUEST_FAILED = "request_failed"  # RequestOutput.error_code of a per-request fault


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, grows with tokens
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_registered_blocks: int = 0  # blocks whose hashes are in the prefix cache
    num_preemptions: int = 0
    hold_kv: bool = False  # prefill mode: keep blocks after finishing, under a lease
    remote_kv: Any = None  # KVHandle to pull before decoding (decode mode)
    error: str = ""
    error_code: str = ""  # with FINISHED_ERROR: REQUEST_FAILED, or empty (a worker fault)
    grammar: Any = None  # xgrammar matcher of a structured-output request (engine/structured.py)
    first_scheduled_time: float | None = None
    hash_root: int = 0  # the parent of block 0's hash: the cache salt's root, see hashing.py

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1


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
    queue_seconds: float | None = None  # arrival to first schedule, on the first output
    # One (logprob, top [(id, logprob)]) per token id, when the request asked for logprobs.
    logprobs: list[Any] | None = None

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
            queue_seconds=self.queue_seconds
            if self.queue_seconds is not None
            else later.queue_seconds,
        )


def _joined(a: list[Any] | None, b: list[Any] | None) -> list[Any] | None:
    if a is None and b is None:
        return None
    return (a or []) + (b or [])
