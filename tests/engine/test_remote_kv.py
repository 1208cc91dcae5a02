"""Decode mode: a request arrives with a KV handle and waits in WAITING_FOR_REMOTE_KV.

A prefill engine (``hold_kv``) computes the prompt and holds its blocks; a decode
engine pulls them through a connector. The connector here is an in-process fake
that copies blocks between the two pools: it stands in for the NIXL connector of
``pdserve.transfer`` (tested on its own there), so that these tests can control
when a load finishes, fails or is cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free

from pdserve.engine.kv_connector import KVConnector, LoadResult
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.engine.sched_output import ScheduledChunk
from pdserve.protocol.hashing import block_hashes
from pdserve.protocol.outputs import HANDOFF, RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from pdserve.transfer.messages import KVHandle

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = [(i * 37) % 2900 + 5 for i in range(70)]  # 4 full blocks and a partial one
MAX_TOKENS = 12


class InProcessConnector(KVConnector):
    """Copies blocks from pool tensor ``src`` into ``dst`` when polled (unless told to fail
    or hold)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.src, self.dst = src, dst
        self.pending: dict[str, tuple[list[int], list[int]]] = {}
        self.cancelled: set[str] = set()
        self.fail = False
        self.quarantine = False  # report loads as failed reads that could not be stopped
        self.lifted: list[str] = []  # quarantines the next unquarantined() lifts
        self.hold = False  # keep every load in flight
        self.started: list[tuple[str, list[int], list[int]]] = []

    def start_load(
        self, request_id: str, handle: Any, remote_block_ids: list[int], local_block_ids: list[int]
    ) -> None:
        assert len(remote_block_ids) == len(local_block_ids)
        self.pending[request_id] = (remote_block_ids, local_block_ids)
        self.started.append((request_id, remote_block_ids, local_block_ids))

    def poll(self) -> list[LoadResult]:
        if self.hold:
            return []
        results = []
        for rid, (remote, local) in self.pending.items():
            if rid in self.cancelled:
                results.append(LoadResult(rid, False, "cancelled"))
            elif self.quarantine:
                results.append(LoadResult(rid, False, "injected stuck read", quarantined=True))
            elif self.fail:
                results.append(LoadResult(rid, False, "injected failure"))
            else:
                self.dst[:, :, local] = self.src[:, :, remote]
                results.append(LoadResult(rid, True))
        self.pending.clear()
        return results

    def cancel(self, request_id: str) -> None:
        self.cancelled.add(request_id)

    def unquarantined(self) -> list[str]:
        out, self.lifted = self.lifted, []
        return out


@pytest.fixture(scope="module")
def reference(hf_model: Any) -> list[int]:
    return hf_greedy(hf_model, PROMPT, MAX_TOKENS)


@pytest.fixture
def pair(
    make_engine: Callable[..., LLMEngine],
) -> tuple[LLMEngine, LLMEngine, InProcessConnector]:
    prefill, decode = make_engine(num_blocks=64), make_engine(num_blocks=64)
    connector = InProcessConnector(prefill.kv.tensor, decode.kv.tensor)
    decode.attach_connector(connector)
    return prefill, decode, connector


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prefill(engine: LLMEngine, rid: str) -> tuple[KVHandle, int]:
    engine.add_request(rid, PROMPT, _greedy(), hold_kv=True)
    outs = []
    while engine.has_work:
        outs += engine.step()
    (out,) = outs
    assert out.finish_reason == HANDOFF and out.kv_block_ids is not None
    assert len(out.token_ids) == 1 and rid in engine.held
    handle = KVHandle(
        request_id=rid,
        agent_name="prefill",
        side_channel="tcp://inproc:1",
        block_ids=out.kv_block_ids,
        num_tokens=len(PROMPT),
        block_hashes=block_hashes(PROMPT, engine.config.block_size),
        block_size=engine.config.block_size,
        nonce="n",
        lease_ttl_s=60,
    )
    handle.validate()
    return handle, out.token_ids[0]


def _all_freed(prefill: LLMEngine, decode: LLMEngine, rid: str) -> None:
    """The prefill side ends its hold; then every block on both sides is free."""
    assert prefill.release_held(rid)
    assert_all_free(prefill)
    assert_all_free(decode)


def _record_chunks(engine: LLMEngine) -> list[int]:
    """Token counts of every chunk the engine's model runs."""
    sizes: list[int] = []
    execute = engine.runner.execute

    def recording(chunks: list[ScheduledChunk]) -> Any:
        sizes.extend(c.num_tokens for c in chunks)
        return execute(chunks)

    engine.runner.execute = recording  # type: ignore[method-assign]
    return sizes


def _drain(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while engine.has_work:
        outs += engine.step()
    return outs


def _decode(decode: LLMEngine, rid: str, handle: KVHandle, first: int) -> list[RequestOutput]:
    decode.add_request(rid, PROMPT, _greedy(), remote_kv=handle, first_token_id=first)
    return _drain(decode)


def test_loaded_kv_decodes_like_transformers(pair: Any, reference: list[int]) -> None:
    prefill, decode, connector = pair
    handle, first = _prefill(prefill, "a")
    assert first == reference[0]
    sizes = _record_chunks(decode)
    decode.add_request("a", PROMPT, _greedy(), remote_kv=handle, first_token_id=first)
    decode.step()  # admitted: blocks allocated, load started, nothing computed
    assert decode.requests["a"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert connector.started == [("a", handle.block_ids, decode.requests["a"].block_ids[:5])]
    outs = _drain(decode)
    assert [t for o in outs for t in o.token_ids] == reference[1:]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == MAX_TOKENS
    assert set(sizes) == {1}  # only decodes ran here: the prompt came over the "wire"
    assert prefill.release_held("a")
    assert_all_free(prefill)
    assert_all_free(decode)


def test_decode_side_prefix_cache_skips_cached_blocks(pair: Any, reference: list[int]) -> None:
    prefill, decode, connector = pair
    handle, first = _prefill(prefill, "a")
    _decode(decode, "a", handle, first)
    prefill.release_held("a")
    handle, first = _prefill(prefill, "b")  # the same prompt again
    outs = _decode(decode, "b", handle, first)
    assert [t for o in outs for t in o.token_ids] == reference[1:]
    rid, remote, _local = connector.started[-1]
    assert rid == "b" and remote == handle.block_ids[4:]  # 4 full blocks were cached
    assert outs[-1].num_cached_tokens == 64
    prefill.release_held("b")
    assert_all_free(prefill)
    assert_all_free(decode)


def test_failed_load_is_recomputed(pair: Any, reference: list[int]) -> None:
    prefill, decode, connector = pair
    handle, first = _prefill(prefill, "a")
    connector.fail = True
    sizes = _record_chunks(decode)
    outs = _decode(decode, "a", handle, first)
    assert [t for o in outs for t in o.token_ids] == reference[1:]
    assert sizes[0] == len(PROMPT) + 1  # prompt and first token recomputed locally
    _all_freed(prefill, decode, "a")


def test_failed_load_fails_the_request_without_recompute(pair: Any) -> None:
    prefill, decode, connector = pair
    decode.scheduler.recompute_on_load_failure = False
    handle, first = _prefill(prefill, "a")
    connector.fail = True
    outs = _decode(decode, "a", handle, first)
    assert [o.finish_reason for o in outs] == ["error"]
    assert "injected failure" in outs[0].error
    _all_freed(prefill, decode, "a")


def test_abort_while_loading_frees_blocks_only_after_poll(pair: Any) -> None:
    prefill, decode, connector = pair
    handle, first = _prefill(prefill, "a")
    connector.hold = True
    decode.add_request("a", PROMPT, _greedy(), remote_kv=handle, first_token_id=first)
    decode.step()
    out = decode.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert "a" in connector.cancelled
    owned = decode.kv.num_used_blocks
    assert owned == 5  # a transfer may still write into them: not free yet
    decode.step()
    assert decode.kv.num_used_blocks == 5
    connector.hold = False
    decode.step()  # the connector reports the cancelled load: now the blocks are free
    assert not decode.scheduler.loading
    _all_freed(prefill, decode, "a")


def test_bad_handles_are_rejected(pair: Any) -> None:
    prefill, decode, _ = pair
    handle, first = _prefill(prefill, "a")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"first_token_id": None}, "first_token_id"),
        ({"first_token_id": 10**6}, "first_token_id"),
        ({"handle": replace(handle, num_tokens=3)}, "kv_handle"),
        ({"handle": replace(handle, block_size=32)}, "kv_handle"),
        ({"handle": replace(handle, block_hashes=[1, 2, 3, 4])}, "kv_handle"),
    ]
    for change, field_name in cases:
        kwargs: dict[str, Any] = {"remote_kv": handle, "first_token_id": first}
        if "handle" in change:
            kwargs["remote_kv"] = change["handle"]
        else:
            kwargs.update(change)
        with pytest.raises(InvalidParameter) as err:
            decode.add_request("x", PROMPT, _greedy(), **kwargs)
        assert err.value.field == field_name
    assert not decode.has_work
    _all_freed(prefill, decode, "a")


def test_quarantined_blocks_stay_owned_until_the_read_stops(pair: Any) -> None:
    """A read the transport could not stop may still write its blocks: the request fails,
    the blocks stay owned (never reused, never cached) until the connector lifts them."""
    prefill, decode, connector = pair
    handle, first = _prefill(prefill, "a")
    connector.quarantine = True
    outs = _decode(decode, "a", handle, first)
    assert [o.finish_reason for o in outs] == ["error"]
    assert "could not be stopped" in outs[0].error
    assert decode.kv.num_used_blocks == 5
    assert not decode.requests and list(decode.kv.quarantined) == ["a"]
    assert decode.kv.cached_prefix(block_hashes(PROMPT, 16), len(PROMPT)) == []  # not cached
    decode.free_released()
    assert decode.kv.num_used_blocks == 5  # not lifted yet
    connector.lifted.append("a")
    decode.free_released()
    assert not decode.kv.quarantined
    _all_freed(prefill, decode, "a")
