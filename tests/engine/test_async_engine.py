"""AsyncEngine: concurrent streams, aborts, early exits, hooks, stats."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import assert_all_free, hf_greedy, tiny_config

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(tiny_config(tiny_model_dir, 128), idle_interval=0.01)
    yield eng
    eng.shutdown()
    assert not eng.alive


async def _all_free(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Wait for the engine thread to settle, then run the leak check on it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await engine.call(lambda e: e.has_work or bool(e.requests)):
        assert loop.time() < deadline, "engine did not settle"
        await asyncio.sleep(0.01)
    await engine.call(assert_all_free)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], n: int) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, prompt, _greedy(n))]


async def test_concurrent_streams_match_transformers(engine: AsyncEngine, hf_model: Any) -> None:
    prompts = [[0, *range(300, 300 + n)] for n in (3, 40, 120, 17, 64, 9)]
    lengths = [20, 5, 33, 12, 1, 27]
    pairs = enumerate(zip(prompts, lengths, strict=True))
    streams = await asyncio.gather(*(_collect(engine, f"r{i}", p, n) for i, (p, n) in pairs))
    for prompt, n, outs in zip(prompts, lengths, streams, strict=True):
        assert [t for o in outs for t in o.token_ids] == hf_greedy(hf_model, prompt, n)
        assert len(outs) > n // 2  # streamed as the engine steps (a lagging reader merges)
        assert all(o.token_ids for o in outs)
        # only the last output is final (a lagging reader gets merged deltas: fewer than n)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final = outs[-1]
        assert final.finish_reason == "length"
        assert final.usage == {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "cached_tokens": 0,
        }
    await _all_free(engine)


async def test_a_reader_that_falls_behind_gets_one_merged_delta(engine: AsyncEngine) -> None:
    prompt, n = [0, *range(300, 310)], 24
    expected = [t for o in await _collect(engine, "ref", prompt, n) for t in o.token_ids]
    outs = []
    async for out in engine.generate("slow", prompt, _greedy(n)):
        outs.append(out)
        if len(outs) == 1:  # the engine runs on while this reader is away
            while await engine.call(lambda e: "slow" in e.requests):
                await asyncio.sleep(0.01)
    assert len(outs) == 2 and outs[1].finish_reason == "length"
    assert [t for o in outs for t in o.token_ids] == expected
    assert outs[1].num_output_tokens == n and outs[0].queue_seconds is not None
    await _all_free(engine)


def test_then_joins_two_deltas() -> None:
    a = RequestOutput("r", [5], "a", None, 3, 1, 0, queue_seconds=0.5)
    b = RequestOutput("r", [6, 7], "bc", "stop", 3, 3, 0)
    assert a.then(b) == RequestOutput("r", [5, 6, 7], "abc", "stop", 3, 3, 0, queue_seconds=0.5)
    with pytest.raises(AssertionError):
        b.then(a)  # nothing follows a finished delta


async def test_abort_mid_stream_frees_blocks(engine: AsyncEngine) -> None:
    outs = []
    async for out in engine.generate("long", [0, *range(10, 90)], _greedy(1000)):
        outs.append(out)
        if len(outs) == 3:
            engine.abort("long")
    assert outs[-1].finish_reason == "abort"
    assert 3 <= len(outs) < 100
    await _all_free(engine)


async def test_leaving_the_iteration_early_aborts(engine: AsyncEngine) -> None:
    stream = engine.generate("early", [0, *range(10, 90)], _greedy(1000))
    async for out in stream:
        assert not out.finished
        break
    await stream.aclose()  # what `async with aclosing(...)` does
    await _all_free(engine)
    # Without aclose: the dropped generator is finalised by the event loop, which aborts.
    async for out in engine.generate("dropped", [0, *range(10, 90)], _greedy(1000)):
        assert not out.finished
        break
    await _all_free(engine)


async def test_cancelled_consumer_aborts(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("cancel-me", [0, *range(10, 90)], _greedy(1000)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _all_free(engine)


async def test_invalid_request_raises_before_any_output(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidParameter) as err:
        async for _ in engine.generate("bad", [0, 5], SamplingParams(max_tokens=-1)):
            pytest.fail("no output expected")
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidParameter) as err:
        async for _ in engine.generate("bad", [], _greedy(3)):
            pytest.fail("no output expected")
    assert err.value.field == "prompt"
    outs = await _collect(engine, "bad", [0, 5], 3)  # the id is free again
    assert outs[-1].finish_reason == "length"
    await _all_free(engine)


async def test_hooks_run_after_steps_and_when_idle(engine: AsyncEngine) -> None:
    calls: list[tuple[int, bool]] = []

    def hook(e: LLMEngine) -> None:
        calls.append((e.num_generation_tokens, e.has_work))

    def broken(e: LLMEngine) -> None:
        raise RuntimeError("a failing hook is logged, not fatal")

    engine.hooks += [broken, hook]
    await asyncio.sleep(0.1)
    idle_calls = len(calls)
    assert idle_calls >= 2  # every idle_interval with nothing to do
    await _collect(engine, "h", [0, 7, 8], 6)
    busy = [c for c in calls[idle_calls:] if c[1]]
    assert len(busy) >= 5  # after every step
    assert engine.alive
    await _all_free(engine)


async def test_stats_and_call(engine: AsyncEngine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_total == 128 and stats.kv_blocks_free == 128
    seen_running = 0
    async for out in engine.generate("s", [0, *range(10, 50)], _greedy(20)):
        seen_running = max(seen_running, engine.stats().running)
        del out
    assert seen_running == 1
    await asyncio.sleep(0.05)
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.generation_tokens == 20 and stats.prompt_tokens == 41
    assert await engine.call(lambda e: e.served_model_name) == "tiny-seed0"
    with pytest.raises(ZeroDivisionError):
        await engine.call(lambda e: 1 // 0)
    await _all_free(engine)


async def test_engine_thread_is_named_at_os_level(engine: AsyncEngine) -> None:
    """bench/stream_overhead.py finds the engine thread in /proc by this name (CI has no
    ptrace for py-spy)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("prctl is Linux's")
    tid = await engine.call(lambda e: threading.get_native_id())
    assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "pdserve-engine"
