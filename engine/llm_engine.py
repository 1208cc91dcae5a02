"""The engine: a step is schedule → execute → update.

The one front object (``add_request`` / ``step`` / ``abort`` / ``stats``), a thin
coordinator over the parts that do the work, in the order of a request's life::

    add_request ─▶ InputProcessor   validate, build the Request (input_processor.py)
                       │
    step ───────▶ Scheduler        token budget, admission, preemption (scheduler.py)
                       │            remote KV loads through the connector
                  ModelRunner      the forward over the paged KV pool (model_runner.py)
                  Sampler          one token per sampling request (sampler.py)
                       │
                  OutputProcessor  stop rules, detokenize, RequestOutputs (output_processor.py)
                       │
                  KVCacheManager   blocks freed, cached, held or quarantined (kv_manager.py)

Synchronous and single-threaded; a worker runs it in its engine core process
(``pdserve.worker.core.loop.CoreLoop``). Workers use two extra modes:

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
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer

from pdserve.engine import compile_job, model_seal
from pdserve.engine.compile_job import CompileJob
from pdserve.engine.config import EngineConfig
from pdserve.engine.draft_proposer import DraftProposer, check_vocab, draft_config, sized
from pdserve.engine.input_processor import InputProcessor
from pdserve.engine.kv_connector import KVConnector, KVHolder, LoadResult
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.kv_pool import KVPool, budget_bytes
from pdserve.engine.logprobs import StepLogprobs
from pdserve.engine.lora_registry import LoraRegistry
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.output_processor import OutputProcessor, eos_ids, make_output, with_logprobs
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampler import Sampler
from pdserve.engine.sched_output import ScheduledChunk
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec_config import SpecConfig, parse_speculative
from pdserve.engine.spec_decode import SpecDecoder, merge_outputs, rollback
from pdserve.engine.structured import Grammars
from pdserve.protocol.contract import EngineStats
from pdserve.protocol.outputs import HANDOFF, REQUEST_FAILED, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.kv_tiers.store import TieredStore

logger = logging.getLogger(__name__)
SHADOW_BLOCKS = 48  # the compile thread's pool: the warm-up's and the probe's requests


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        recompute_on_load_failure: bool = True,
        runner: ModelRunner | None = None,
    ) -> None:
        """``runner``: a loaded model's runner, pool unbound (``shadow``)."""
        self.config = config
        if config.cpu_threads is not None:  # process-wide: one engine per worker process
            torch.set_num_threads(config.cpu_threads)
        # A shared cache: the files as first loaded, read once and loaded from what was
        # hashed (engine/model_seal.py); None: loaded by path.
        sealed = model_seal.load(
            config.model, weights=model_seal.LOAD if runner is None else model_seal.SKIP
        )
        files = str(sealed.files) if sealed is not None else config.model
        self.tokenizer = AutoTokenizer.from_pretrained(files, local_files_only=True)
        self.runner = runner or ModelRunner(config)
        budget = budget_bytes(self.runner.device, config.kv_cache_bytes, config.kv_cache_fraction)
        pool = KVPool.from_budget(self.runner.kv_shape, budget, self.runner.device)
        self.runner.bind_pool(pool)
        kv = KVCacheManager(pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, kv, connector, recompute_on_load_failure)
        self.kv = self.scheduler.kv  # the scheduler's; the engine frees, holds and reads
        self.sampler = Sampler(self.runner.device, config.seed)
        self.max_model_len = min(
            config.max_model_len or self.runner.max_position_embeddings,
            self.runner.max_position_embeddings,
        )
        eos = eos_ids(self.tokenizer, self.runner.hf_config)
        self.vocab_size = int(self.runner.hf_config.vocab_size)
        self.grammars = Grammars(
            self.tokenizer, self.vocab_size, sorted(eos), config.grammar_cache_bytes
        )
        self.model_id = self.runner.model_id
        self.served_model_name = config.served_model_name or Path(config.model).name
        self.inputs = InputProcessor(
            config,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.kv,
            self.grammars,
            lambda: getattr(self.scheduler.connector, "transport_name", None),
            self.runner.loras,
        )
        self.outputs = OutputProcessor(eos, self.max_model_len)
        spec = parse_speculative(config.speculative)
        self.spec = (
            SpecDecoder(spec, self.max_model_len, self.vocab_size, self._draft_proposer(spec))
            if spec
            else None
        )
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.tier_store: TieredStore | None = None
        if config.kv_tiers is not None:
            from pdserve.engine.kv_tiers.attach import attach

            self.tier_store = attach(self, config.kv_tiers)
        self.hands_off = False  # the start-up probe holds its prefill's KV (prefill role)
        self.step_failures = 0  # steps that raised (step_fault.py)
        self.fault, self.fault_at = "", 0.0  # the standing step failure: unready
        self.compile_job: CompileJob | None = None  # start_compile: in the background
        now = config.compile and not config.compile_in_background and runner is None
        self.compile_seconds = compile_job.warm_up(self) if now else 0.0
        # Drafting starts after a warm-up compile (its one-decode step stays T = 1); a
        # compile in the background covers steps with drafts too (T >= 2, several rows).
        if self.spec is not None:
            self.scheduler.drafter = self.spec.draft

    def _draft_proposer(self, spec: SpecConfig) -> DraftProposer | None:
        """``draft:model=PATH``: the draft model in an engine of its own, on this one's
        device and dtype, its pool sized for this engine's longest request; refused by
        name unless it shares this engine's tokenizer (engine/draft_proposer.py)."""
        if spec.method != "draft":
            return None
        cfg = draft_config(self.config, spec.model)
        runner = ModelRunner(cfg)
        draft = LLMEngine(
            sized(cfg, runner.kv_shape.bytes_per_block, self.max_model_len), runner=runner
        )
        check_vocab(draft, self, spec.model)
        return DraftProposer(draft, spec.k)

    def shadow(self, blocks: int = SHADOW_BLOCKS) -> LLMEngine:
        """An engine on this one's model (the same module and weights) with a small KV
        pool of its own and no compile: the compile thread's (compile_job.py)."""
        runner = self.runner.unbound()
        runner.forward = self.runner.model
        budget = blocks * runner.kv_shape.bytes_per_block
        config = replace(
            self.config,
            kv_cache_bytes=budget,
            kv_cache_fraction=None,
            compile=False,
            enable_prefix_caching=False,
            kv_tiers=None,
            speculative=None,
        )
        return LLMEngine(config, runner=runner)

    def start_compile(self, quiet_s: float = 0.0, max_hold_s: float = 0.0) -> None:
        """Compile the forward in the background while the eager one serves; it is
        swapped in between steps once compiled and checked (compile_job.py). With
        ``quiet_s``, the compile waits until the engine has had no work that long (at most
        ``max_hold_s``): a worker's first requests do not share its CPU with it."""
        if self.runner.compile_wanted and not self.runner.compiled:
            self.compile_job = CompileJob(self, quiet_s, max_hold_s)
            self.compile_job.start()

    @property
    def compile_state(self) -> str:
        """off | compiling | ready | compiled | eager-kept (compile_job.py)."""
        if self.compile_job is not None:
            return self.compile_job.state
        return compile_job.COMPILED if self.runner.compiled else compile_job.OFF

    def maybe_swap(self) -> bool:
        """Between steps: the compiled forward takes over once it is ready."""
        return self.compile_job is not None and self.compile_job.maybe_swap()

    def forget_warm_up(self) -> None:
        """Start-up generations leave no trace: counters, prefix cache, KV events."""
        assert not self.has_work and self.kv.all_free
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.scheduler.num_preemptions = self.scheduler.num_prefix_hit_tokens = 0
        self.kv.reset_prefix_cache()
        self.kv.drain_events()
        self.drain_tier_events()

    @property
    def eos_token_ids(self) -> set[int]:
        return self.outputs.eos_token_ids

    # -- requests --------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        **kwargs: Any,
    ) -> None:
        """Queue a request; raises InvalidParameter for bad input, RequestFailed when
        building its state fails otherwise (nothing is queued either way).

        Keyword arguments (``InputProcessor.process``): ``hold_kv``, ``remote_kv`` with
        ``first_token_id``, ``resume_token_ids``, ``cache_salt``. ``resume_token_ids``:
        output tokens this request already produced (and sent) elsewhere, as when the
        router migrates a stream off a dead decode worker. They count as outputs
        (max_tokens, min_tokens, stop strings); their KV is recomputed here like a
        preempted request's, and their text is not sent again.
        """
        if request_id in self.requests or request_id in self.held:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        req, text = self.inputs.process(request_id, prompt_token_ids, params, **kwargs)
        self.outputs.add(request_id, text)
        self.requests[request_id] = req
        self.num_prompt_tokens += req.num_prompt_tokens
        self.scheduler.add(req)

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
        self.kv.attach_holder(holder)

    @property
    def loras(self) -> LoraRegistry | None:
        """The runner's LoRA adapters (engine/lora_registry.py); None: off."""
        return self.runner.loras

    @property
    def kv_tensor(self) -> torch.Tensor:
        """The KV pool's one tensor: what a KV transport registers (kv_manager.py)."""
        return self.kv.tensor  # type: ignore[no-any-return]

    @property
    def held(self) -> set[str]:
        return self.kv.held_ids()

    def release_held(self, request_id: str) -> bool:
        released = self.kv.release(request_id)
        self.free_released()
        return released

    def free_released(self) -> None:
        """Take back the blocks of ended holds and of reads that stopped (engine thread;
        every step, and from an idle hook so leases end while nothing runs)."""
        self.kv.reclaim(self.scheduler.connector)

    # -- the step --------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def has_runnable(self) -> bool:
        """A step has tokens to compute: requests running or waiting, not only KV loads
        (remote or from a tier) that the core loop polls for."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        if self.compile_job is not None:
            self.compile_job.maybe_swap()
        self.free_released()
        sched = self.scheduler.schedule()
        outputs = self._settle_loads(sched.loaded)
        if sched.chunks:
            sampled = self._row_requests(sched.chunks)
            logits = self.runner.execute(sched.chunks)
            raw = StepLogprobs(logits, sampled)  # before the sampler edits the logits
            tokens = self._sample(logits, sampled)
            outputs += self._update(sched.chunks, tokens, raw)
        return outputs

    def _row_requests(self, chunks: list[ScheduledChunk]) -> list[Request]:
        """The request of each sampled row (speculative chunks: views, drafts appended)."""
        if self.spec is None:
            return [c.request for c in chunks if c.samples]
        return self.spec.row_requests(chunks)

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
        banned = self.outputs.banned
        try:
            self.grammars.apply(logits, reqs)
            return list(self.sampler.sample(logits, reqs, [banned(r) for r in reqs]))
        except Exception:
            logger.exception("batched sampling failed; sampling request by request")
        out: list[int | Exception] = []
        for i, req in enumerate(reqs):
            try:
                row = pristine[i : i + 1].clone() if edits else logits[i : i + 1]
                self.grammars.apply(row, [req])
                out += self.sampler.sample(row, [req], [banned(req)])
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
            if chunk.draft:
                rows = [next(it) for _ in range(chunk.num_rows)]
                out = self._verify(chunk, [t for t, _ in rows], [lp for _, lp in rows])
                if out is not None:
                    outputs.append(out)
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.kv.register_computed(req)
            if not chunk.samples:
                continue
            out = self._emit(req, *next(it))
            if out is not None:
                outputs.append(out)
        return outputs

    def _verify(
        self, chunk: ScheduledChunk, tokens: list[int | Exception], logprobs: list[Any]
    ) -> RequestOutput | None:
        """A speculative chunk's rows sampled: emit the accepted drafts and the token after
        them, one by one through the stop rules; roll back the rejected drafts' KV."""
        assert self.spec is not None
        req = chunk.request
        emitted = self.spec.accepted(req, chunk.draft, tokens)
        rollback(req, self.kv.block_manager, len(emitted) - 1, chunk.start)
        self.kv.register_computed(req)
        outs: list[RequestOutput] = []
        for token, lp in zip(emitted, logprobs, strict=False):
            out = self._emit(req, token, lp)
            if out is not None:
                outs.append(out)
                self.spec.stats.emitted_tokens += len(out.token_ids)
            if out is None or out.finished:
                break
        return merge_outputs(outs)

    def _emit(self, req: Request, token: int | Exception, lp: Any) -> RequestOutput | None:
        """A sampled token through the stop rules and detokenization, with its logprobs;
        a failure there (or a failed row) ends this request alone."""
        try:
            if isinstance(token, Exception):
                raise token
            out = self._append_token(req, token)
        except Exception as exc:
            out = self._fail_request(req, exc)
        return None if out is None else with_logprobs(out, req, lp)

    def _fail_request(self, req: Request, exc: Exception) -> RequestOutput:
        """End ``req`` alone with an error; the rest of the batch goes on."""
        logger.error("request %s failed in the step", req.request_id, exc_info=exc)
        req.error_code = REQUEST_FAILED
        msg = f"request failed: {type(exc).__name__}: {exc}"[:500]
        if req.request_id not in self.requests:  # it had ended; its output was lost
            req.status, req.error = RequestStatus.FINISHED_ERROR, msg
            return make_output(req, [], "", RequestStatus.FINISHED_ERROR.value)
        return self.finish(req, RequestStatus.FINISHED_ERROR, [], "", msg)

    def _append_token(self, req: Request, token: int) -> RequestOutput | None:
        if req.grammar is not None and not req.grammar.accept_token(token):
            msg = f"token {token} broke the request's grammar"  # only if the mask was not applied
            return self.finish(req, RequestStatus.FINISHED_ERROR, [], "", msg)
        req.output_token_ids.append(token)
        self.num_generation_tokens += 1
        self.kv.extend_hashes(req)
        status, text = self.outputs.check_stop(req, token)
        if status is not None:
            return self.finish(req, status, [token], text)
        if req.hold_kv:
            return self._handoff(req, token, text)
        return make_output(req, [token], text, None)

    # -- endings ---------------------------------------------------------------
    def finish(
        self, req: Request, status: RequestStatus, token_ids: list[int], text: str, error: str = ""
    ) -> RequestOutput:
        req.status, req.error = status, error
        self.scheduler.remove(req)
        if req.request_id not in self.scheduler.loading:  # else freed once the load stops
            self._drop(req)
        return make_output(req, token_ids, text, status.value)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error; their final outputs."""
        return [
            self.finish(req, RequestStatus.FINISHED_ERROR, [], "", message)
            for req in list(self.requests.values())
            if not req.status.finished
        ]

    def _handoff(self, req: Request, token: int, text: str) -> RequestOutput:
        req.status = RequestStatus.FINISHED_STOPPED
        self.scheduler.remove(req)
        handle, block_ids, hashes = self.kv.hold(req)
        if req.lora is not None and handle is not None:  # the decode side checks it
            handle = replace(handle, lora=req.lora.ref)
        self._drop(req)
        out = make_output(req, [token], text, HANDOFF)
        return replace(out, kv_block_ids=block_ids, kv_block_hashes=hashes, kv_handle=handle)

    def _drop(self, req: Request) -> None:
        self.kv.free_request(req)
        self.requests.pop(req.request_id, None)
        self.outputs.forget(req.request_id)
        self.sampler.forget(req.request_id)
        if self.spec is not None:
            self.spec.forget(req.request_id)

    def _settle_loads(self, loaded: list[tuple[Request, LoadResult]]) -> list[RequestOutput]:
        outputs = []
        for req, result in loaded:
            if result.quarantined:  # the read may still write these blocks: keep them
                self.kv.quarantine(req)
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
                self.kv.register_computed(req)
        return outputs

    # -- introspection ---------------------------------------------------------
    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        return self.kv.drain_events()

    def drain_tier_events(self) -> list[tuple[str, str, list[int]]]:
        """(kind, tier, block hashes) of the KV tiers since the last call."""
        return self.tier_store.drain_events() if self.tier_store is not None else []

    def stats(self) -> EngineStats:
        s = self.scheduler
        queued = sum(r.num_uncomputed_tokens for r in s.waiting) + sum(
            r.num_uncomputed_tokens for r in s.running if r.is_prefilling
        )
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            loading=s.num_loading,
            held=len(self.held),
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_blocks,
            queued_prompt_tokens=queued,
            prefix_cache_hit_tokens=s.num_prefix_hit_tokens + s.num_tier_hit_tokens,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            preemptions=s.num_preemptions,
            loras=self.runner.loras.resident if self.runner.loras else [],
            lora_known=sorted(self.runner.loras.known) if self.runner.loras else [],
            compile=self.compile_state,
            step_failures=self.step_failures,
            fault=self.fault,
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
