"""Admission: a request's input checked and turned into its engine state.

Everything here runs before the request is queued, so a bad request is refused whole
(``InvalidParameter`` naming the field: a 400) and nothing of it stays behind. Its
state (the ``Request``, its block hashes, its text stream, its grammar matcher) is built
here; if that fails otherwise the request alone fails (``RequestFailed``: a 422).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import TextStream
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.lora_registry import LoraAdapter, LoraRegistry, check_handle
from pdserve.engine.request import Request, tenant_of
from pdserve.engine.structured import Grammars
from pdserve.protocol.contract import KVHandle, LoraRef
from pdserve.protocol.hashing import block_hashes, salt_root
from pdserve.protocol.outputs import RequestFailed
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)


class InputProcessor:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        kv: KVCacheManager,
        grammars: Grammars,
        transport_name: Callable[[], str | None],
        loras: LoraRegistry | None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv
        self.grammars = grammars
        self.transport_name = transport_name  # the decode connector's, once attached
        self.loras = loras  # the runner's adapters (engine/lora_registry.py); None: off

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
        remote_kv: Any = None,
        first_token_id: int | None = None,
        resume_token_ids: list[int] | None = None,
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
    ) -> tuple[Request, TextStream]:
        """The request and its text stream; see ``LLMEngine.add_request``."""
        self.validate(prompt_token_ids, params.validate(self.vocab_size))
        adapter = self._adapter(lora)
        try:
            req, text = self._build(request_id, prompt_token_ids, params, hold_kv, cache_salt)
            if adapter is not None:  # its KV is keyed by the adapter (hashing.salt_root)
                req.lora, req.hash_root = adapter, salt_root(cache_salt, adapter.spec.hash)
                req.block_hashes = block_hashes(
                    req.prompt_token_ids, self.config.block_size, req.hash_root
                )
            if remote_kv is not None:
                self._check_handle(req, remote_kv, first_token_id)
                req.remote_kv = remote_kv
                req.output_token_ids.append(int(first_token_id))  # type: ignore[arg-type]
            elif resume_token_ids:
                self._check_resume(req, resume_token_ids)
                req.output_token_ids.extend(int(t) for t in resume_token_ids)
            if req.output_token_ids:  # already sent by the prefill worker / the worker that died
                self.kv.extend_hashes(req)
                text.replay(req.output_token_ids)
            if params.structured is not None:  # replays the first token, or the resumed ones
                req.grammar = self.grammars.matcher(params.structured, req.output_token_ids)
        except InvalidParameter:
            raise
        except Exception as exc:  # this request's own state cannot be built: it alone fails
            logger.exception("request %s could not be added", request_id)
            raise RequestFailed(f"request could not be started: {type(exc).__name__}") from exc
        return req, text

    def _adapter(self, lora: LoraRef | None) -> LoraAdapter | None:
        if lora is None:
            return None
        if self.loras is None:
            raise InvalidParameter("lora", "this engine serves no LoRA adapters")
        return self.loras.resolve(lora)

    def _build(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool,
        cache_salt: str | None,
    ) -> tuple[Request, TextStream]:
        req = Request(request_id, list(prompt_token_ids), params, hold_kv=hold_kv)
        req.hash_root = salt_root(cache_salt)
        req.tenant = tenant_of(cache_salt)
        req.block_hashes = block_hashes(req.prompt_token_ids, self.config.block_size, req.hash_root)
        return req, TextStream(self.tokenizer, req.prompt_token_ids, params.stop)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidParameter("prompt", "prompt must not be empty")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens",
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens",
            )
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise InvalidParameter(
                "logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size})"
            )
        need = self.kv.blocks_needed(n + params.max_tokens)
        if need > self.kv.num_blocks:
            raise InvalidParameter(
                "max_tokens",
                f"prompt + max_tokens need {need} KV blocks; "
                f"the KV cache holds {self.kv.num_blocks}",
            )

    def _check_handle(self, req: Request, handle: Any, first_token_id: int | None) -> None:
        if first_token_id is None or not 0 <= first_token_id < self.vocab_size:
            raise InvalidParameter("first_token_id", "a KV handle needs a valid first_token_id")
        if not isinstance(handle, KVHandle):
            raise InvalidParameter("kv_handle", f"expected a KVHandle, got {type(handle)}")
        check_handle(req.lora, handle.lora)  # before the hashes, which the adapter seeds
        if handle.num_tokens != req.num_prompt_tokens:
            raise InvalidParameter(
                "kv_handle",
                f"kv_handle covers {handle.num_tokens} tokens, prompt has {req.num_prompt_tokens}",
            )
        err = handle.problem(self.transport_name(), self.config.block_size, req.block_hashes)
        if err:
            raise InvalidParameter("kv_handle", err)
        if req.params.max_tokens < 2:
            raise InvalidParameter("max_tokens", "a handed-off request needs max_tokens >= 2")

    def _check_resume(self, req: Request, ids: list[int]) -> None:
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise InvalidParameter(
                "resume_token_ids", f"resume token ids must be in [0, {self.vocab_size})"
            )
        if len(ids) >= req.params.max_tokens:
            raise InvalidParameter("resume_token_ids", "resume_token_ids reach max_tokens")
