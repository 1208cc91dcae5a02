"""The router ↔ worker contract: every message of the workers' internal HTTP API.

One typed message per body, all through :mod:`pdserve.protocol.codec` (JSON with a ``"type"``
field); nothing else builds or parses a worker message as a dict.

=====================  =================  ==========================================
route                  worker             request → reply
=====================  =================  ==========================================
``POST /prefill``      prefill            :class:`PrefillRequest` → :class:`PrefillReply`
``POST /generate``     decode             :class:`GenerateRequest` → NDJSON, one
                                          :class:`TokenDelta` per line
``GET /stats``         both               :class:`WorkerStats`
``POST /abort``        both               :class:`RequestRef` → :class:`AbortReply`
``POST /release``      prefill            :class:`RequestRef` → :class:`ReleaseReply`
=====================  =================  ==========================================

``CONTRACT_VERSION`` is in every ``WorkerStats`` (the router keeps a worker of another
version out of rotation) and in the KV side channel's handshake (``transfer/messages.py``).
Errors stay OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with HTTP
4xx (the request is wrong: not retried) or 5xx (the worker failed: retried elsewhere).

The sampling parameters are a typed field passed through whole: a new sampling option
is added to :class:`~pdserve.protocol.sampling_params.SamplingParams` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.protocol.codec import message, to_dict
from pdserve.protocol.fast_dumps import JsonList
from pdserve.protocol.once import once
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams, valid_text

# 3: LoRA (``lora`` on the requests and the KV handle, ``loras`` / ``lora_known`` in the stats)
CONTRACT_VERSION = 3
MAX_CACHE_SALT_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256
MAX_LORA_NAME_CHARS = 256
LORA_HASH_CHARS = 32  # hex blake2b-128 of the adapter's files (engine/lora_files.py)


MAX_PREFILL_CANDIDATES = 8


def _check_prefill(urls: list[str], handle: KVHandle | None, resume: list[int] | None) -> None:
    """A chained request's prefill workers: 1 to 8 http(s) base URLs of printable text,
    and nothing that says the prompt is already computed."""
    if handle is not None or resume:
        raise InvalidParameter("prefill", "prefill comes without a kv_handle or resume_token_ids")
    if not 0 < len(urls) <= MAX_PREFILL_CANDIDATES:
        raise InvalidParameter("prefill", f"prefill names 1 to {MAX_PREFILL_CANDIDATES} workers")
    for url in urls:
        if not (url.startswith(("http://", "https://")) and url.isprintable() and len(url) < 2048):
            raise InvalidParameter("prefill", f"prefill: {url[:80]!r} is not an http(s) URL")


def _check_ids(request_id: str, cache_salt: str | None) -> None:
    """The request id and the prefix-cache salt (the router's tenant salt and the client's
    ``cache_salt``, which enters the block hashes: pdserve/protocol/hashing.py)."""
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidParameter(
            "request_id", "request_id must be a printable string of at most 256 characters"
        )
    if not valid_text(request_id):
        raise InvalidParameter("request_id", "request_id is not valid Unicode")
    if cache_salt is not None and (
        not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS or not valid_text(cache_salt)
    ):
        raise InvalidParameter(
            "cache_salt",
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
        )


@message("lora_ref")
@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter: its name, and the hash of its files where the sender knows it. The
    hash seeds the prompt's block hashes (hashing.salt_root's ``extra_key``), so KV
    computed under one adapter never serves another; a decode worker whose adapter of
    that name has another hash refuses (``lora_mismatch``): never other weights."""

    name: str
    hash: str | None = None

    def validate(self) -> None:
        if not valid_lora_name(self.name):
            raise InvalidParameter(
                "lora.name",
                f"lora.name must be printable, 1 to {MAX_LORA_NAME_CHARS} characters",
            )
        if self.hash is not None and not valid_lora_hash(self.hash):
            raise InvalidParameter(
                "lora.hash", f"lora.hash must be {LORA_HASH_CHARS} lowercase hex digits"
            )


def valid_lora_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and 0 < len(name) <= MAX_LORA_NAME_CHARS
        and name.isprintable()
        and valid_text(name)
    )


def valid_lora_hash(digest: object) -> bool:
    return (
        isinstance(digest, str)
        and len(digest) == LORA_HASH_CHARS
        and all(c in "0123456789abcdef" for c in digest)
    )


@message("kv_handle")
@dataclass(frozen=True)
class KVHandle:
    """A single-use lease on a prompt's KV blocks held by one prefill worker.

    The lease's clock runs on the prefill side only; ``lease_ttl_s`` says how long the
    prefill side keeps the blocks unclaimed (information for logs and tests, not a wall
    time to compare across hosts). The decode side claims the lease with ``nonce`` over
    the side channel before it reads (docs/kv_transfer.md); a second claim is refused."""

    request_id: str  # the lease id
    agent_name: str  # the prefill worker's NIXL agent (or tcp peer) name
    side_channel: str  # ZeroMQ address of the prefill worker's side channel
    block_ids: list[int]  # block ids in the prefill worker's KV pool, in prompt order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    block_hashes: list[int]  # chained hashes of the full blocks (len == num_tokens // block_size)
    block_size: int
    nonce: str  # single-use claim token
    lease_ttl_s: float  # how long the prefill side keeps the blocks unclaimed
    transport: str = "nixl"
    version: int = CONTRACT_VERSION
    lora: LoraRef | None = None  # the adapter the KV was computed under (None: base model)

    @once
    def wire(self) -> dict[str, Any]:
        """The codec's form (``to_dict``), kept: the router hands a prefill reply's handle
        to the decode worker as the body it read (``prefill_reply`` keeps it), not built
        again field by field. Shared: read it, never change it."""
        got = to_dict(self)
        got["block_hashes"] = JsonList(got["block_hashes"])  # 128-bit: json writes them
        return got

    def validate(self) -> None:
        if self.version != CONTRACT_VERSION:
            raise ValueError(f"kv_handle version {self.version} != {CONTRACT_VERSION}")
        if self.lora is not None and not (
            valid_lora_name(self.lora.name) and valid_lora_hash(self.lora.hash)
        ):
            raise ValueError("kv_handle.lora needs a valid name and hash")
        if self.num_tokens <= 0 or self.block_size <= 0:
            raise ValueError("kv_handle.num_tokens and block_size must be positive")
        need = -(-self.num_tokens // self.block_size)
        if len(self.block_ids) != need:
            raise ValueError(
                f"kv_handle has {len(self.block_ids)} block ids for {self.num_tokens} tokens "
                f"(block size {self.block_size} needs {need})"
            )
        if any((not isinstance(b, int)) or b < 0 for b in self.block_ids):
            raise ValueError("kv_handle.block_ids must be non-negative integers")
        if len(self.block_hashes) > self.num_tokens // self.block_size:
            raise ValueError("kv_handle has more block hashes than full blocks")
        if not self.nonce:
            raise ValueError("kv_handle.nonce must not be empty")
        if not self.side_channel.startswith("tcp://"):
            raise ValueError(f"side channel {self.side_channel!r} is not a tcp:// address")

    def problem(
        self, transport: str | None, block_size: int, prompt_hashes: list[int] | None
    ) -> str:
        """Every check a decode worker makes before it claims: "" or what is wrong.

        ``transport`` / ``prompt_hashes``: this worker's transport and the block hashes of
        the prompt the handle came with (None: not known here). One place, so the engine
        and the connector agree."""
        try:
            self.validate()
        except ValueError as exc:
            return f"bad kv handle: {exc}"
        if transport is not None and self.transport != transport:
            return f"kv handle is for transport {self.transport!r}, this worker uses {transport!r}"
        if self.block_size != block_size:
            return f"kv handle block size {self.block_size} != local block size {block_size}"
        if prompt_hashes is not None and list(self.block_hashes) != prompt_hashes:
            return "kv handle block hashes do not match the prompt"
        return ""


@message("usage")
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@message("worker_error")
@dataclass(frozen=True)
class WorkerError:
    """OpenAI's error object, as a worker sends it in a stream line."""

    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


@message("prefill_request")
@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    lora: LoraRef | None = None  # run under this adapter (None: the base model)

    def validate(self) -> None:
        _check_ids(self.request_id, self.cache_salt)
        if self.lora is not None:
            self.lora.validate()


@message("prefill_reply")
@dataclass(frozen=True)
class PrefillReply:
    """The first token; ``kv_handle`` is None when the request already finished."""

    request_id: str
    first_token_id: int
    text: str
    finish_reason: str | None
    kv_handle: KVHandle | None
    num_cached_tokens: int
    prompt_tokens: int
    usage: Usage | None = None
    logprobs: list[Any] | None = None  # the first token's, when the request asked
    prompt_logprobs: list[Any] | None = None  # per prompt token, when the request asked


@message("generate_request")
@dataclass(frozen=True)
class GenerateRequest:
    """Decode this prompt; with ``kv_handle`` its KV comes from a prefill worker and
    ``first_token_id`` is the token that worker sampled (already sent to the client)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_handle: KVHandle | None = None
    first_token_id: int | None = None
    cache_salt: str | None = None
    # A stream migrated off a decode worker that died: every output token already sent
    # (recomputed here, counted as output, not repeated). Never with a kv_handle.
    resume_token_ids: list[int] | None = None
    lora: LoraRef | None = None  # run under this adapter (None: the base model)
    # The router's ``--pd-handoff decode``: the prefill workers to call, in order (the
    # router's prefix-aware pick first); this worker prefills there, streams the first
    # token, then pulls the KV (decode_worker/chain.py). Never with a kv_handle.
    prefill: list[str] | None = None

    def validate(self) -> None:
        _check_ids(self.request_id, self.cache_salt)
        if self.lora is not None:
            self.lora.validate()
        if self.prefill is not None:
            _check_prefill(self.prefill, self.kv_handle, self.resume_token_ids)
        if self.kv_handle is not None and self.first_token_id is None:
            raise InvalidParameter("first_token_id", "a kv_handle needs an integer first_token_id")
        if self.kv_handle is not None and self.resume_token_ids:
            raise InvalidParameter("resume_token_ids", "resume_token_ids come without a kv_handle")


@message("token_delta")
@dataclass(frozen=True)
class TokenDelta:
    """One NDJSON line of a decode worker's stream; ``usage`` on the last one. A line with
    ``error`` ends the stream: the request failed on that worker (``code``
    ``request_failed``: this request alone, not to be retried elsewhere)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    error: WorkerError | None = None
    logprobs: list[Any] | None = None  # per token, when the request asked
    # On the first line of a request prefilled here that asked: [logprob, rank, top] per
    # prompt token, the first None (engine/prompt_logprobs.py).
    prompt_logprobs: list[Any] | None = None

    def then(self, later: TokenDelta) -> TokenDelta:
        """This delta and a ``later`` one as one message (a reader that fell behind)."""
        ids, text = self.token_ids + later.token_ids, self.text + later.text
        lps = None
        if self.logprobs is not None or later.logprobs is not None:
            lps = (self.logprobs or []) + (later.logprobs or [])
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return replace(later, token_ids=ids, text=text, logprobs=lps, prompt_logprobs=prompt)

    @property
    def ends_run(self) -> bool:
        return self.error is not None or self.finish_reason is not None


@message("engine_stats")
@dataclass(frozen=True)
class EngineStats:
    """The engine's counters (``LLMEngine.stats``); the first fields of ``WorkerStats``."""

    running: int = 0
    waiting: int = 0
    loading: int = 0  # waiting for remote KV
    held: int = 0  # prefill: requests whose KV is held under a lease
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    queued_prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    loras: list[str] = field(default_factory=list)  # LoRA adapters resident in the model now
    lora_known: list[str] = field(default_factory=list)  # all it serves without a path
    compile: str = ""  # the forward: off | compiling | ready | compiled | eager-kept
    step_failures: int = 0  # engine steps that raised (the core's count since start)
    fault: str = ""  # the last step failure while it stands: the worker is unready


@message("worker_stats")
@dataclass(frozen=True)
class WorkerStats(EngineStats):
    """``GET /stats``: the engine's counters plus who the worker is. Also what routing
    reads (``router/scheduling/snapshot.py``), with these defaults for a worker not yet polled."""

    role: str = ""
    worker_id: str = ""
    pid: int = 0
    core_pid: int = 0  # its engine core's process (a child, or forked by a core zygote)
    model: str = ""
    model_id: str = ""
    block_size: int = 16
    max_model_len: int = 0
    kv_transport: str = ""
    kv_events: str = ""  # prefill: ZeroMQ address of its KV events
    side_channel: str = ""  # prefill: ZeroMQ address of its KV side channel
    version: int = CONTRACT_VERSION


@message("request_ref")
@dataclass(frozen=True)
class RequestRef:
    request_id: str

    def validate(self) -> None:
        _check_ids(self.request_id, None)


@message("abort_reply")
@dataclass(frozen=True)
class AbortReply:
    aborted: bool


@message("release_reply")
@dataclass(frozen=True)
class ReleaseReply:
    released: bool
