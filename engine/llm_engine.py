"""The engine: a step is schedule → execute → update.

Synchronous and single-threaded; :class:`pdserve.engine.async_engine.AsyncEngine`
runs it on its own thread for servers. Workers use two extra modes:

* ``hold_kv`` (prefill): the request ends after its first token with finish
  reason ``handoff``; its blocks go to the KV holder (``attach_holder``; by default
  an in-process one), which owns them, the lease and the handle until the hold ends.
* ``remote_kv`` (decode): the request arrives with a KV handle and the prefill
  worker's first token; its prompt KV is pulled by the connector.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from pdserve.engine import compiled, prompt_logprobs
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import TextStream
from pdserve.engine.kv_connector import HeldBlocks, KVConnector, KVHolder
from pdserve.engine.kv_pool import KVPool, budget_bytes
from pdserve.engine.logprobs import StepLogprobs
from pdserve.engine.model_runner import ModelRunner, ScheduledChunk, model_identity
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler, tenant_of
from pdserve.engine.structured import Grammars
from pdserve.protocol.contract import EngineStats, KVHandle
from pdserve.protocol.hashing import block_hashes, hash_block, salt_root
from pdserve.protocol.outputs import HANDOFF, REQUEST_FAILED, RequestFailed, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        recompute_on_load_failure: bool = True,
    ) -> None:
        self.config = config
        if config.cpu_threads is not None:  # process-wide: one engine per worker process
            torch.set_num_threads(config.cpu_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
        self.runner = ModelRunner(config)
        budget = budget_bytes(self.runner.device, config.kv_cache_bytes, config.kv_cache_fraction)
        self.pool = KVPool.from_budget(self.runner.kv_shape, budget, self.runner.device)
        self.runner.bind_pool(self.pool)
        self.blocks = BlockManager(
            self.pool.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.blocks, connector, recompute_on_load_failure)
        self.sampler = Sampler(self.runner.device, config.seed)
        self.max_model_len = min(
            config.max_model_len or self.runner.max_position_embeddings,
            self.runner.max_position_embeddings,
        )
        self.eos_token_ids = _eos_ids(self.tokenizer, self.runner.hf_config)
        self.vocab_size = int(self.runner.hf_config.vocab_size)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                 config.grammar_cache_bytes)  # fmt: skip
        self.model_id = model_identity(config.model)
        self.served_model_name = config.served_model_name or Path(config.model).name
        self.requests: dict[str, Request] = {}
        self.holder: KVHolder = HeldBlocks()
        self.quarantined: dict[str, list[int]] = {}  # blocks a read may still write
        self._text: dict[str, TextStream] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.compile_seconds = compiled.warm_up(self) if config.compile else 0.0

    def forget_warm_up(self) -> None:
        """Start-up generations leave no trace: counters, prefix cache, KV events."""
        assert not self.has_work and self.blocks.num_free_blocks == self.blocks.num_blocks
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.scheduler.num_preemptions = self.scheduler.num_prefix_hit_tokens = 0
        self.blocks.reset_prefix_cache()
        self.blocks.drain_events()

    # -- requests --------------------------------------------------------------
    def add_request(
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
    ) -> None:
        """Queue a request; raises InvalidParameter for bad input, RequestFailed when
        building its state fails otherwise (nothing is queued either way).

        ``resume_token_ids``: output tokens this request already produced (and sent)
        elsewhere, as when the router migrates a stream off a dead decode worker. They
        count as outputs (max_tokens, min_tokens, stop strings); their KV is recomputed
        here like a preempted request's, and their text is not sent again.
        """
        if request_id in self.requests or request_id in self.held:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params.validate(self.vocab_size))
        try:
            req, text = self._build(request_id, prompt_token_ids, params, hold_kv, cache_salt)
            if remote_kv is not None:
                self._check_handle(req, remote_kv, first_token_id)
                req.remote_kv = remote_kv
                req.output_token_ids.append(int(first_token_id))  # type: ignore[arg-type]
            elif resume_token_ids:
                self._check_resume(req, resume_token_ids)
                req.output_token_ids.extend(int(t) for t in resume_token_ids)
            if req.output_token_ids:  # already sent by the prefill worker / the worker that died
                self._extend_hashes(req)
                text.append(req.output_token_ids)
            if params.structured is not None:  # replays the first token, or the resumed ones
                req.grammar = self.grammars.matcher(params.structured, req.output_token_ids)
        except InvalidParameter:
            raise
        except Exception as exc:  # this request's own state cannot be built: it alone fails
            logger.exception("request %s could not be added", request_id)
            raise RequestFailed(f"request could not be started: {type(exc).__name__}") from exc
        self._text[request_id] = text
        self.requests[request_id] = req
        self.num_prompt_tokens += req.num_prompt_tokens
        self.scheduler.add(req)

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
        need = self.blocks.blocks_needed(n + params.max_tokens)
        if need > self.blocks.num_blocks:
            raise InvalidParameter(
                "max_tokens",
                f"prompt + max_tokens need {need} KV blocks; "
                f"the KV cache holds {self.blocks.num_blocks}",
            )

    def _check_handle(self, req: Request, handle: Any, first_token_id: int | None) -> None:
        if first_token_id is None or not 0 <= first_token_id < self.vocab_size:
            raise InvalidParameter("first_token_id", "a KV handle needs a valid first_token_id")
        if not isinstance(handle, KVHandle):
            raise InvalidParameter("kv_handle", f"expected a KVHandle, got {type(handle)}")
        if handle.num_tokens != req.num_prompt_tokens:
            raise InvalidParameter(
                "kv_handle",
                f"kv_handle covers {handle.num_tokens} tokens, prompt has {req.num_prompt_tokens}",
            )
        transport = getattr(self.scheduler.connector, "transport_name", None)
        err = handle.problem(transport, self.config.block_size, req.block_hashes)
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

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks (or its held blocks). None if unknown."""
        if request_id in self.held:
            self.release_held(request_id)
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self.finish(req, RequestStatus.FINISHED_ABORTED, [], "")

    def attach_connector(self, connector: KVConnector) -> None:
        """Set the decode-side connector; it needs the pool, which exists only now."""
        self.scheduler.connector = connector

    def attach_holder(self, holder: KVHolder) -> None:
        """Set the prefill-side holder (before any request is handed off)."""
        assert not self.held, "requests are held already"
        self.holder = holder

    @property
    def held(self) -> set[str]:
        return self.holder.held_ids()

    def release_held(self, request_id: str) -> bool:
        released = self.holder.release(request_id)
        self.free_released()
        return released

    def free_released(self) -> None:
        """Take back the blocks of ended holds and of reads that stopped (engine thread;
        every step, and from an idle hook so leases end while nothing runs)."""
        for block_ids in self.holder.freed():
            self.blocks.free(block_ids)
        connector = self.scheduler.connector
        for rid in connector.unquarantined() if connector is not None else []:
            self.blocks.free(self.quarantined.pop(rid, []))

    # -- the step --------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[RequestOutput]:
        self.free_released()
        sched = self.scheduler.schedule()
        outputs = self._settle_loads(sched.loaded)
        if sched.chunks:
            sampled = [c.request for c in sched.chunks if c.samples]
            logits = self.runner.execute(sched.chunks)
            raw = StepLogprobs(logits, sampled)  # before the sampler edits the logits
            tokens = self._sample(logits, sampled)
            outputs += self._update(sched.chunks, tokens, raw)
        return outputs

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int | Exception]:
        """One token per request, or the exception that its own sampling raised.

        The batch is sampled at once (grammar masks, then the sampler); if that
        fails, row by row from the logits as they came from the model, so that a
        request whose values break the sampler fails alone (a seeded neighbour's
        draw of this one step may then differ from a solo run).
        """
        # Biases and penalties edit the logits in place: keep the model's for a retry.
        edits = any(r.params.has_penalties or r.params.logit_bias for r in reqs)
        pristine = logits.clone() if edits else logits
        try:
            self.grammars.apply(logits, reqs)
            return list(self.sampler.sample(logits, reqs, [self._banned(r) for r in reqs]))
        except Exception:
            logger.exception("batched sampling failed; sampling request by request")
        out: list[int | Exception] = []
        for i, req in enumerate(reqs):
            try:
                row = pristine[i : i + 1].clone() if edits else logits[i : i + 1]
                self.grammars.apply(row, [req])
                out += self.sampler.sample(row, [req], [self._banned(req)])
            except Exception as exc:
                out.append(exc)
        return out

    def _update(
        self,
        chunks: list[ScheduledChunk],
        tokens: list[int | Exception],
        raw: StepLogprobs,
    ) -> list[RequestOutput]:
        outputs = []
        logprobs = raw.of([t if isinstance(t, int) else 0 for t in tokens])  # 0: a failed row
        it = iter(zip(tokens, logprobs, strict=True))
        for chunk in chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            self._register_blocks(req)
            if not chunk.samples:
                continue
            token, lp = next(it)
            try:  # stop handling, detokenization: this request's own work
                if isinstance(token, Exception):
                    raise token
                out = self._append_token(req, token)
            except Exception as exc:
                out = self._fail_request(req, exc)
            if out is not None:
                outputs.append(_with_logprobs(out, req, lp))
        return outputs

    def _fail_request(self, req: Request, exc: Exception) -> RequestOutput:
        """End ``req`` alone with an error; the rest of the batch goes on."""
        logger.error("request %s failed in the step", req.request_id, exc_info=exc)
        req.error_code = REQUEST_FAILED
        msg = f"request failed: {type(exc).__name__}: {exc}"[:500]
        if req.request_id not in self.requests:  # it had ended; its output was lost
            req.status, req.error = RequestStatus.FINISHED_ERROR, msg
            return self._output(req, [], "", RequestStatus.FINISHED_ERROR.value)
        return self.finish(req, RequestStatus.FINISHED_ERROR, [], "", msg)

    def _append_token(self, req: Request, token: int) -> RequestOutput | None:
        if req.grammar is not None and not req.grammar.accept_token(token):
            msg = f"token {token} broke the request's grammar"  # only if the mask was not applied
            return self.finish(req, RequestStatus.FINISHED_ERROR, [], "", msg)
        req.output_token_ids.append(token)
        self.num_generation_tokens += 1
        self._extend_hashes(req)
        p = req.params
        text = self._text[req.request_id]
        if token in p.stop_token_ids or (
            token in self.eos_token_ids
            and not p.ignore_eos
            and req.num_output_tokens > p.min_tokens
        ):
            return self.finish(req, RequestStatus.FINISHED_STOPPED, [token], text.finish().text)
        delta = text.append([token])
        if delta.stop is not None:
            return self.finish(req, RequestStatus.FINISHED_STOPPED, [token], delta.text)
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            tail = text.finish().text
            return self.finish(req, RequestStatus.FINISHED_LENGTH, [token], delta.text + tail)
        if req.hold_kv:
            return self._handoff(req, token, delta.text)
        return self._output(req, [token], delta.text, None)

    # -- endings ---------------------------------------------------------------
    def finish(
        self, req: Request, status: RequestStatus, token_ids: list[int], text: str, error: str = ""
    ) -> RequestOutput:
        req.status, req.error = status, error
        self.scheduler.remove(req)
        if req.request_id not in self.scheduler.loading:  # else freed once the load stops
            self._drop(req)
        return self._output(req, token_ids, text, status.value)

    def _handoff(self, req: Request, token: int, text: str) -> RequestOutput:
        req.status = RequestStatus.FINISHED_STOPPED
        self.scheduler.remove(req)
        block_ids, req.block_ids = req.block_ids, []
        num_prompt_blocks = self.blocks.blocks_needed(req.num_prompt_tokens)
        hashes = req.block_hashes[: req.num_prompt_tokens // self.config.block_size]
        handle = self.holder.hold(req.request_id, block_ids, req.num_prompt_tokens, hashes)
        self._drop(req)
        out = self._output(req, [token], text, HANDOFF)
        return replace(
            out,
            kv_block_ids=block_ids[:num_prompt_blocks],
            kv_block_hashes=hashes,
            kv_handle=handle,
        )

    def _drop(self, req: Request) -> None:
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        self.requests.pop(req.request_id, None)
        self._text.pop(req.request_id, None)
        self.sampler.forget(req.request_id)

    def _settle_loads(self, loaded: list) -> list[RequestOutput]:  # type: ignore[type-arg]
        outputs = []
        for req, result in loaded:
            if result.quarantined:  # the read may still write these blocks: keep them
                self.quarantined[req.request_id], req.block_ids = req.block_ids, []
                if not req.status.finished:
                    msg = f"KV transfer failed and could not be stopped: {result.error}"
                    outputs.append(self.finish(req, RequestStatus.FINISHED_ERROR, [], "", msg))
                else:
                    self._drop(req)
            elif req.status.finished:  # aborted while its KV was loading
                self._drop(req)
            elif not result.ok and req.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                msg = f"KV transfer failed: {result.error}"
                outputs.append(self.finish(req, RequestStatus.FINISHED_ERROR, [], "", msg))
            elif result.ok:
                self._register_blocks(req)
        return outputs

    def _output(
        self, req: Request, token_ids: list[int], text: str, finish: str | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            text=text,
            finish_reason=finish,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            error_code=req.error_code,
            queue_seconds=(
                req.first_scheduled_time - req.arrival_time
                if req.first_scheduled_time is not None and req.num_output_tokens <= 1
                else None
            ),
        )

    # -- blocks and hashes -----------------------------------------------------
    def _extend_hashes(self, req: Request) -> None:
        bs = self.config.block_size
        full = req.num_tokens // bs
        if full > len(req.block_hashes):
            parent = req.block_hashes[-1] if req.block_hashes else req.hash_root
            tokens = req.all_token_ids
            for i in range(len(req.block_hashes), full):
                parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
                req.block_hashes.append(parent)

    def _register_blocks(self, req: Request) -> None:
        full = min(req.num_computed_tokens // self.config.block_size, len(req.block_hashes))
        if full > req.num_registered_blocks:
            self.blocks.register(req.block_ids, req.block_hashes[:full], req.num_registered_blocks)
            req.num_registered_blocks = full

    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        return self.blocks.drain_events()

    def _banned(self, req: Request) -> list[int]:
        if req.num_output_tokens < req.params.min_tokens and not req.params.ignore_eos:
            return sorted(self.eos_token_ids | set(req.params.stop_token_ids))
        return []

    # -- introspection ---------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        queued = sum(r.num_uncomputed_tokens for r in s.waiting) + sum(
            r.num_uncomputed_tokens for r in s.running if r.is_prefilling
        )
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            loading=len(s.loading),
            held=len(self.held),
            kv_blocks_free=self.blocks.num_free_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            queued_prompt_tokens=queued,
            prefix_cache_hit_tokens=s.num_prefix_hit_tokens,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            preemptions=s.num_preemptions,
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion (tests, benchmarks); returns output token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{id(prompts)}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_work:
            for out in self.step():
                results[out.request_id].extend(out.token_ids)
        return [results[rid] for rid in ids]


def _with_logprobs(out: RequestOutput, req: Request, lp: Any) -> RequestOutput:
    """The sampled token's logprobs, and the prompt's on the request's first output."""
    prompt = prompt_logprobs.take(req)
    if lp is None and prompt is None:
        return out
    return replace(out, logprobs=[lp] if lp is not None else None, prompt_logprobs=prompt)


def _eos_ids(tokenizer: Any, hf_config: Any) -> set[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    return ids
