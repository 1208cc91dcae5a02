"""Structured-output grammars bounded (issue 24 item 3), in the engine core's loop.

* A request aborted while its grammar compiles is never added: the compile is held (a
  patched compile that waits on an event) until after the abort arrives; the request must
  not enter the engine afterwards, and its stream ends as aborted. Without the fix the add
  follows the compile and the request decodes to max_tokens for nobody.
* A compile past ``--grammar-compile-timeout`` is refused with 400 naming the field, and
  the next request's grammar compiles on a fresh thread instead of queueing behind it.
* Compiles run one at a time, round robin across tenants (the router's key salt): one
  key's burst of schemas does not hold another key's behind it.
* The compiled-grammar cache is bounded in bytes (xgrammar's own cache is off): distinct
  schemas evict the least recently used, never growing past the bound.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from engine_helpers import assert_all_free, tiny_config

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.structured import Grammars
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.engine_probes import SCHEMA, abandoned_probe
from pdserve.testing.engine_probes import core_messages as _messages
from pdserve.testing.engine_probes import grammar_add as _add
from pdserve.worker.core.loop import CoreLoop

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(tiny_config(tiny_model_dir))


@pytest.fixture
def loop(engine: LLMEngine) -> Any:
    ctx = zmq.Context()
    commands, results = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    commands.bind("inproc://c")
    results.bind("inproc://r")
    reader = ctx.socket(zmq.PAIR)
    reader.connect("inproc://r")
    core = CoreLoop(engine, commands, results)
    yield core, reader
    for s in (commands, results, reader):
        s.close(0)
    ctx.term()


def _held_compile(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    release = threading.Event()
    real = engine.grammars.compile

    def held(spec: dict[str, Any]) -> Any:
        release.wait(30)
        return real(spec)

    monkeypatch.setattr(engine.grammars, "compile", held)
    return release


def test_abort_while_compiling_is_never_added(engine, loop, monkeypatch) -> None:
    core, reader = loop
    release = _held_compile(engine, monkeypatch)
    core._command(_add("held"))
    compiling = core._compiling[0].future
    core._add_compiled()  # still compiling: nothing added
    core._command(("abort", "held"))
    release.set()
    compiling.result(timeout=30)  # the compile finishes after the abort
    core._add_compiled()
    assert "held" not in engine.requests and not engine.has_work
    outs = [o for m in _messages(reader) if m[0] == "out" for o in m[2]]
    assert [(o.request_id, o.finish_reason) for o in outs] == [("held", "abort")]
    assert_all_free(engine)


def test_compile_past_its_deadline_is_refused(engine, loop, monkeypatch) -> None:
    core, reader = loop
    core.compile_timeout_s = 0.3
    release = _held_compile(engine, monkeypatch)
    core._command(_add("slow"))
    time.sleep(0.4)
    core._add_compiled()
    rejected = [m for m in _messages(reader) if m[0] == "rejected"]
    assert rejected and rejected[0][1:4] == ("slow", "invalid", "response_format")
    assert "--grammar-compile-timeout" in rejected[0][4]
    monkeypatch.undo()  # another key's next compile is quick, on the fresh thread
    core._command(_add("next", "k:other|r:x"))
    deadline = time.monotonic() + 10
    while "next" not in engine.requests and time.monotonic() < deadline:
        core._add_compiled()
        time.sleep(0.01)
    assert "next" in engine.requests and "slow" not in engine.requests
    release.set()
    engine.abort("next")
    assert_all_free(engine)


def test_compiles_are_served_round_robin_across_tenants(engine, loop, monkeypatch) -> None:
    core, _ = loop
    order: list[str] = []
    real = engine.grammars.compile

    def recording(spec: dict[str, Any]) -> Any:
        order.append(spec["schema"]["title"])  # the add's own lookup comes again: a hit
        return real(spec)

    monkeypatch.setattr(engine.grammars, "compile", recording)
    rids = ["a1", "a2", "a3", "b1"]
    for rid in rids:
        core._command(_add(rid, f"k:{rid[0]}|r:x"))
    deadline = time.monotonic() + 30
    while len(set(order)) < 4 or core._compiling:
        core._add_compiled()
        time.sleep(0.005)
        assert time.monotonic() < deadline
    assert list(dict.fromkeys(order)) == [
        "a1",
        "b1",
        "a2",
        "a3",
    ]  # first come first served would be a1 a2 a3 b1
    for rid in rids:
        engine.abort(rid)
    assert_all_free(engine)


def test_grammar_cache_is_bounded_in_bytes(engine: LLMEngine) -> None:
    one = engine.grammars.compile({"type": "json_schema", "schema": SCHEMA})
    size = int(one.memory_size_bytes)
    grammars = Grammars(engine.tokenizer, engine.vocab_size, [2], cache_bytes=3 * size + size // 2)
    for i in range(8):  # distinct schemas of about the same size
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        grammars.compile({"type": "json_schema", "schema": schema})
        assert grammars.cached_bytes <= grammars.cache_bytes
    assert len(grammars._cache) < 8 and grammars.num_compiled == 8
    grammars.compile(
        {
            "type": "json_schema",
            "schema": {"type": "object", "properties": {"k0": {"type": "integer"}}},
        }
    )
    assert grammars.num_compiled == 9  # the oldest was evicted: compiled again


def test_an_unexpected_error_adding_a_request_answers_it_alone(engine, loop, monkeypatch) -> None:
    """A bug in add_request (any exception, not a refusal) fails that request with an answer
    (its stream must not hang) and leaves the loop serving the next one."""
    core, reader = loop
    real = engine.add_request

    def broken(request_id: str, *args: Any, **kwargs: Any) -> Any:
        if request_id == "bad":
            raise TypeError("injected")
        return real(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", broken)
    plain = SamplingParams(max_tokens=2)
    core._command(("add", "bad", [5, 6, 7], plain, {}))
    rejected = [m for m in _messages(reader) if m[0] == "rejected"]
    assert rejected and rejected[0][1:3] == ("bad", "failed"), rejected
    assert "TypeError" in rejected[0][4]
    core._command(("add", "good", [5, 6, 7], plain, {}))
    assert "good" in engine.requests
    while engine.has_work:
        engine.step()
    assert_all_free(engine)


def test_abandoned_compiles_are_bounded_and_their_key_backed_off(engine, loop, monkeypatch) -> None:
    core, reader = loop
    release = _held_compile(engine, monkeypatch)
    try:
        assert abandoned_probe(core, reader, engine) == 0
        assert core.abandoned.running() == core.abandoned.bound
        # the key behind a timeout is refused at once, naming the field
        core._command(_add("again", "k:0|r:x"))
        (msg,) = [m for m in _messages(reader) if m[0] == "rejected"]
        assert msg[1:4] == ("again", "invalid", "response_format") and "refused" in msg[4]
        monkeypatch.undo()
        core._command(_add("other", "k:fresh|r:x"))  # waits for the bound, then compiles
        core._add_compiled()
        assert "other" not in engine.requests and not core._compiling
    finally:
        release.set()
    deadline = time.monotonic() + 20
    while "other" not in engine.requests and time.monotonic() < deadline:
        core._add_compiled()
        time.sleep(0.01)
    assert "other" in engine.requests
    for rid in list(engine.requests):  # "other", and a probe compile that finished in time
        engine.abort(rid)
    assert_all_free(engine)
