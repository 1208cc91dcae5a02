"""The one serving path, as a worker runs it: EngineClient (the front end) → the engine core
process (worker/core/main.py) → CoreLoop → LLMEngine. Concurrent streams, a reader that
falls behind, aborts, early exits, refusals before the first output, stats, queries, the
core's hooks and its thread name. (These were AsyncEngine's tests; nothing served through
AsyncEngine, so it is gone and they run here.)"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from engine_helpers import TINY_BLOCK_BYTES, assert_all_free, tiny_config

from pdserve.decode_worker import server as decode_server
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.outputs import RequestOutput
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.loopback import free_port
from pdserve.worker.core.client import EngineClient
from pdserve.worker.core.loop import CoreLoop
from pdserve.worker.http import core_config

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster]  # a real engine core process
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[EngineClient]:
    parser = argparse.ArgumentParser()
    decode_server.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--kv-cache-bytes",
            str(NUM_BLOCKS * TINY_BLOCK_BYTES),
            "--enforce-eager",
            "--kv-transport",
            "tcp",
            "--port",
            str(free_port()),
            "--kv-events-port",
            str(free_port()),
        ]
    )
    engine = EngineClient(core_config("decode", args))
    yield engine
    engine.shutdown()
    assert not engine.alive


async def _all_free(
    engine: EngineClient, rids: tuple[str, ...] = (), timeout: float = 20.0
) -> None:
    """The core settles: nothing queued or running, every KV block free, the ids unknown."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        idle = not (s.running or s.waiting or s.loading or s.held)
        known = [rid for rid in rids if await engine.query("known", rid)]
        if idle and s.kv_blocks_free == s.kv_blocks_total == NUM_BLOCKS and not known:
            return
        assert time.monotonic() < deadline, f"core did not settle: {s}, known {known}"
        await asyncio.sleep(0.02)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _collect(
    engine: EngineClient, rid: str, prompt: list[int], n: int
) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, prompt, _greedy(n))]


async def test_concurrent_streams_match_transformers(client: EngineClient, hf_model: Any) -> None:
    prompts = [[0, *range(300, 300 + n)] for n in (3, 40, 120, 17, 64, 9)]
    lengths = [20, 5, 33, 12, 1, 27]
    pairs = enumerate(zip(prompts, lengths, strict=True))
    streams = await asyncio.gather(*(_collect(client, f"r{i}", p, n) for i, (p, n) in pairs))
    for prompt, n, outs in zip(prompts, lengths, streams, strict=True):
        assert [t for o in outs for t in o.token_ids] == hf_greedy(hf_model, prompt, n)
        assert len(outs) > n // 2  # streamed as the core steps (a lagging reader merges)
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
    await _all_free(client, tuple(f"r{i}" for i in range(len(prompts))))


async def test_a_reader_that_falls_behind_gets_one_merged_delta(client: EngineClient) -> None:
    prompt, n = [0, *range(300, 310)], 24
    expected = [t for o in await _collect(client, "ref", prompt, n) for t in o.token_ids]
    outs = []
    async for out in client.generate("slow", prompt, _greedy(n)):
        outs.append(out)
        if len(outs) == 1:  # the core runs on while this reader is away
            while await client.query("known", "slow") or client.stats().running:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the last outputs came with those stats: queued here
    assert len(outs) == 2 and outs[1].finish_reason == "length"
    assert [t for o in outs for t in o.token_ids] == expected
    assert outs[1].num_output_tokens == n and outs[0].queue_seconds is not None
    await _all_free(client, ("ref", "slow"))


def test_then_joins_two_deltas() -> None:
    a = RequestOutput("r", [5], "a", None, 3, 1, 0, queue_seconds=0.5)
    b = RequestOutput("r", [6, 7], "bc", "stop", 3, 3, 0)
    assert a.then(b) == RequestOutput("r", [5, 6, 7], "abc", "stop", 3, 3, 0, queue_seconds=0.5)
    with pytest.raises(AssertionError):
        b.then(a)  # nothing follows a finished delta


async def test_abort_mid_stream_frees_blocks(client: EngineClient) -> None:
    outs = []
    async for out in client.generate("long", [0, *range(10, 90)], _greedy(1000)):
        outs.append(out)
        if len(outs) == 3:
            client.abort("long")
    assert outs[-1].finish_reason == "abort"
    assert 3 <= len(outs) < 100
    await _all_free(client, ("long",))


async def test_leaving_the_iteration_early_aborts(client: EngineClient) -> None:
    stream = client.generate("early", [0, *range(10, 90)], _greedy(1000))
    async for out in stream:
        assert not out.finished
        break
    await stream.aclose()  # type: ignore[attr-defined]  # what `aclosing(...)` does
    await _all_free(client, ("early",))
    # Without aclose: the dropped generator is finalised by the event loop, which aborts.
    async for out in client.generate("dropped", [0, *range(10, 90)], _greedy(1000)):
        assert not out.finished
        break
    await _all_free(client, ("dropped",))


async def test_cancelled_consumer_aborts(client: EngineClient) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in client.generate("cancel-me", [0, *range(10, 90)], _greedy(1000)):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 20)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _all_free(client, ("cancel-me",))


async def test_invalid_request_raises_before_any_output(client: EngineClient) -> None:
    with pytest.raises(InvalidParameter) as err:
        async for _ in client.generate("bad", [0, 5], SamplingParams(max_tokens=-1)):
            pytest.fail("no output expected")
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidParameter) as err:
        async for _ in client.generate("bad", [], _greedy(3)):
            pytest.fail("no output expected")
    assert err.value.field == "prompt"
    outs = await _collect(client, "bad", [0, 5], 3)  # the id is free again
    assert outs[-1].finish_reason == "length"
    await _all_free(client, ("bad",))


async def test_stats_and_queries(client: EngineClient) -> None:
    await _all_free(client)
    before = client.stats()
    assert before.kv_blocks_total == NUM_BLOCKS and before.kv_blocks_free == NUM_BLOCKS
    seen_running = 0
    async for out in client.generate("s", [0, *range(10, 50)], _greedy(20)):
        seen_running = max(seen_running, client.stats().running)
        del out
    assert seen_running == 1
    await _all_free(client, ("s",))
    stats = client.stats()
    assert stats.generation_tokens - before.generation_tokens == 20
    assert stats.prompt_tokens - before.prompt_tokens == 41
    assert client.info["model"] == "tiny-seed0"  # the served name: the model directory's
    assert client.info["block_size"] == 16
    with pytest.raises(RuntimeError, match="no query"):
        await client.query("no-such-query")


def test_engine_thread_is_named_at_os_level(client: EngineClient) -> None:
    """bench/stream_overhead.py finds the engine thread in /proc by this name (CI has no
    ptrace for py-spy): the core process's main thread."""
    names = {
        (task / "comm").read_text().strip()
        for task in Path(f"/proc/{client.proc.pid}/task").iterdir()
    }
    assert "pdserve-engine" in names, names


def test_core_hooks_run_after_steps_and_when_idle(tiny_model_dir: Path) -> None:
    """CoreLoop's hooks (leases, KV events) run on the engine's thread after every step
    and every IDLE_S when idle; a failing hook is logged, not fatal."""
    engine = LLMEngine(tiny_config(tiny_model_dir, NUM_BLOCKS))
    calls: list[tuple[int, bool]] = []

    def hook(e: LLMEngine) -> None:
        calls.append((e.num_generation_tokens, e.has_work))

    def broken(e: LLMEngine) -> None:
        raise RuntimeError("a failing hook is logged, not fatal")

    ctx = zmq.Context()
    commands, results = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    front, reader = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    commands.bind("inproc://hooks-c")
    results.bind("inproc://hooks-r")
    front.connect("inproc://hooks-c")
    reader.connect("inproc://hooks-r")  # the front end's end: the loop's messages go there
    loop = CoreLoop(engine, commands, results, hooks=[broken, hook])
    thread = threading.Thread(target=loop.run, daemon=True)
    try:
        thread.start()
        time.sleep(0.2)
        idle_calls = len(calls)
        assert idle_calls >= 2  # every IDLE_S with nothing to do
        front.send(pickle.dumps(("add", "h", [0, 7, 8], _greedy(6), {})))
        deadline = time.monotonic() + 30
        while engine.num_generation_tokens < 6 or engine.has_work:
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.01)
        busy = [c for c in calls[idle_calls:] if c[1]]
        assert len(busy) >= 5  # after every step
        front.send(pickle.dumps(("stop",)))
        thread.join(10)
        assert not thread.is_alive()
        assert_all_free(engine)
    finally:
        loop.stopped = True
        thread.join(10)
        for s in (commands, results, front, reader):
            s.close(0)
        ctx.term()
