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
    tier_store: TieredStore | None  # kv_tiers/attach.py sets it

    @property
    def runner(self) -> ModelRunner: ...

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def model_id(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def requests(self) -> dict[str, Request]: ...

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
