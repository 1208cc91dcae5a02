"""One object per request, owned by the scheduler.

``num_computed_tokens`` catches up with ``all_token_ids``: a prompt chunk, a
decode step and a recompute after preemption are the same operation. Waiting
for remote KV is one more state.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    WAITING_FOR_TIER_LOAD = "waiting_for_tier_load"  # its prefix comes from a KV tier
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
    lora: Any = None  # the LoraAdapter it runs under (engine/lora_registry.py); None: base
    tenant: str = ""  # the router's key salt ("k:..."), for fair admission (scheduler.py)
    # [None, [logprob, rank, top], ...] per prompt token so far (engine/prompt_logprobs.py)
    prompt_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

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


def tenant_of(cache_salt: str | None) -> str:
    """A request's tenant: the router's key salt, the ``k:`` part of its cache salt
    (router/runtime.py ``cache_salt``); "" without one (the client's own ``r:`` part never
    counts, so a client cannot pose as many tenants by varying it)."""
    head = (cache_salt or "").split("|", 1)[0]
    return head if head.startswith("k:") else ""
