"""A prefill engine and a decode engine in one process, joined by a real KV transfer.

What a prefill worker and a decode worker do around a hand-off, without their processes
or HTTP: the prefill engine (``hold_kv``) holds each prompt's blocks in a real
``KVServer`` (worker/core/prefill.py); the decode engine pulls them through a real
``RemoteKVConnector`` (worker/core/decode.py), over NIXL (UCX) or TCP, handshake, lease
and release included, into a pool of its own. The two engines share one loaded model
(``ModelRunner.unbound``): a model is loaded once, each engine has its own KV pool.
Given a compiled prefill engine, the decode engine runs the same compiled forward
(tests/engine/test_family_compiled.py).

The decode engine never recomputes a prompt (``recompute_on_load_failure=False``): a
failed read fails the request instead of hiding behind a local prefill, and every chunk
the decode engine runs is recorded, so a caller can check it ran decodes only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_connector import KVConnector, LoadResult
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sched_output import ScheduledChunk
from pdserve.protocol.outputs import HANDOFF
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord, KVHandle
from pdserve.transfer.server import KVServer


class RecordingConnector(KVConnector):
    """The decode side's connector, every finished load kept (its bytes, its outcome)."""

    def __init__(self, inner: RemoteKVConnector) -> None:
        self.inner = inner
        self.results: list[LoadResult] = []

    def start_load(
        self, request_id: str, handle: Any, remote_block_ids: list[int], local_block_ids: list[int]
    ) -> None:
        self.inner.start_load(request_id, handle, remote_block_ids, local_block_ids)

    def poll(self) -> list[LoadResult]:
        done = self.inner.poll()
        self.results += done
        return done

    def cancel(self, request_id: str) -> None:
        self.inner.cancel(request_id)

    def unquarantined(self) -> list[str]:
        return self.inner.unquarantined()


@dataclass
class HandOff:
    """What one ``PDPair.run`` did: each prompt's tokens (the prefill engine's first,
    then the decode engine's), the blocks handed off and the bytes read."""

    tokens: list[list[int]]
    blocks: int
    bytes_read: int
    decode_chunks: list[int] = field(default_factory=list)  # tokens of each chunk decode ran


class PDPair:
    """``prefill`` and ``decode`` engines on one model, a KV transfer between them."""

    def __init__(
        self,
        config: EngineConfig,
        transport: str = "nixl",
        decode_kv_bytes: int | None = None,
        transfer_timeout: float = 10.0,
        prefill: LLMEngine | None = None,
    ) -> None:
        """``prefill``: an engine already built on ``config`` (a compiled one: the decode
        engine then serves on the same compiled forward, no second compile)."""
        self.prefill = prefill or LLMEngine(config)
        runner = self.prefill.runner.unbound()
        decode_config = replace(config, kv_cache_bytes=decode_kv_bytes or config.kv_cache_bytes)
        self.decode = LLMEngine(decode_config, runner=runner, recompute_on_load_failure=False)
        p, d = self.prefill, self.decode
        self.server = KVServer(
            p.kv_tensor, CompatRecord.for_pool(p.kv_tensor, p.model_id), transport
        )
        p.attach_holder(self.server)
        try:
            remote = RemoteKVConnector(
                d.kv_tensor,
                CompatRecord.for_pool(d.kv_tensor, d.model_id),
                transport,
                transfer_timeout=transfer_timeout,
            )
        except BaseException:
            self.server.close()
            raise
        self.connector = RecordingConnector(remote)
        d.attach_connector(self.connector)
        self.decode_chunks: list[int] = []
        execute = d.runner.execute

        def recording(chunks: list[ScheduledChunk]) -> Any:
            self.decode_chunks.extend(c.num_tokens for c in chunks)
            return execute(chunks)

        d.runner.execute = recording  # type: ignore[method-assign]

    def run(self, prompts: list[list[int]], max_tokens: int, timeout: float = 60.0) -> HandOff:
        """Greedy ``max_tokens`` for each prompt: all prompts prefilled together (mixed
        lengths in the prefill steps), handed off, and decoded together (mixed context
        lengths in every decode step). Every hold has ended when it returns."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        p, d = self.prefill, self.decode
        ids = [f"pd-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            p.add_request(rid, prompt, params, hold_kv=True)
        handed: dict[str, tuple[KVHandle, int]] = {}
        while p.has_work:
            for out in p.step():
                assert out.finish_reason == HANDOFF, f"{out.request_id}: {out}"
                assert isinstance(out.kv_handle, KVHandle) and len(out.token_ids) == 1
                handed[out.request_id] = (out.kv_handle, out.token_ids[0])
        before, chunks_before = len(self.connector.results), len(self.decode_chunks)
        tokens: dict[str, list[int]] = {}
        for rid, prompt in zip(ids, prompts, strict=True):
            handle, first = handed[rid]
            tokens[rid] = [first]
            d.add_request(rid, prompt, params, remote_kv=handle, first_token_id=first)
        end = time.monotonic() + timeout
        while d.has_work:
            assert time.monotonic() < end, "the decode engine did not finish in time"
            for out in d.step():
                assert not out.error, f"{out.request_id}: {out.error}"
                tokens[out.request_id] += out.token_ids
            p.free_released()  # leases the decode side ended: blocks back to the pool
            if not d.has_runnable:
                time.sleep(0.001)  # a read in flight
        while p.held:  # the last release may still be on the side-channel thread
            assert time.monotonic() < end, f"holds never ended: {p.held}"
            time.sleep(0.001)
        p.free_released()
        loads = self.connector.results[before:]
        assert all(r.ok for r in loads), loads
        return HandOff(
            tokens=[tokens[rid] for rid in ids],
            blocks=sum(len(h.block_ids) for h, _ in handed.values()),
            bytes_read=sum(r.num_bytes for r in loads),
            decode_chunks=self.decode_chunks[chunks_before:],
        )

    def close(self) -> None:
        self.connector.inner.close()
        self.server.close()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
