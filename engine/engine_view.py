"""The engine as its helpers drive it: the start-up probe (startup_probe.py), the compile
job and warm-up (compile_job.py), the KV tiers' hooks (kv_tiers/attach.py) and the draft
model's engine (draft_proposer.py).

``LLMEngine`` (llm_engine.py) is the one implementation. The helpers take this protocol,
not ``LLMEngine``, because the engine imports them: with the protocol the engine's
modules import one another in one direction only (tests/test_import_cycles.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.engine.kv_manager import KVCacheManager
    from pdserve.engine.kv_tiers.store import TieredStore
    from pdserve.engine.model_runner import ModelRunner
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler
    from pdserve.protocol.outputs import RequestOutput
    from pdserve.protocol.sampling_params import SamplingParams


class EngineView(Protocol):
    # LLMEngine.__init__ sets these (tier_store: the store of kv_tiers/attach.py, or None).
    tier_store: TieredStore | None
    runner: ModelRunner
    kv: KVCacheManager
    scheduler: Scheduler
    served_model_name: str
    model_id: str
    vocab_size: int
    max_model_len: int
    tokenizer: Any
    requests: dict[str, Request]

    @property
    def held(self) -> set[str]: ...

    @property
    def has_work(self) -> bool: ...

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def release_held(self, request_id: str) -> bool: ...

    def free_released(self) -> None: ...

    def forget_warm_up(self) -> None: ...

    def shadow(self, blocks: int = ...) -> EngineView: ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]: ...
