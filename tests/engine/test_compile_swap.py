"""The compiled forward built in the background and swapped in between steps
(engine/compile_job.py): requests in flight carry on across the swap, token-identical;
a compiled forward that raises or disagrees with eager is not swapped in.

The suite runs eager (tests/conftest.py sets PDSERVE_ENFORCE_EAGER=1 for the workers it
starts); these engines ask for the compiled forward on purpose (``compile=True``). The
compile shares inductor's on-disk cache with test_fidelity.py's compiled test (the same
tiny model and graph variants), so one of the two pays for code generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free

from pdserve.engine import compile_job
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

PROMPTS = [[5, 6, 7, 8], [9] * 20, [3, 1, 4, 1, 5, 9, 2, 6], [11] * 37]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _background(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    engine = make_engine(num_blocks=128, compile=True, compile_in_background=True)
    assert engine.runner.compile_wanted and not engine.runner.compiled
    assert engine.runner.compiled_fn is None  # made on the compile thread, off the start
    assert engine.compile_state == compile_job.OFF  # nothing started yet: eager serves
    return engine


def _step(engine: LLMEngine, out: dict[str, list[int]]) -> None:
    for o in engine.step():
        assert not o.error, o.error
        out[o.request_id] += o.token_ids


def test_requests_in_flight_across_the_swap(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a first start the CPU attention kernel is not built yet: the worker serves with
    the gather path and swaps both (the kernel's build is faked as needed here: the
    suite's cache holds it already, and a real build takes a minute of CPU)."""
    from torch._dynamo.utils import counters

    from pdserve.engine import attention_backends, cpu_kernel

    expected = make_engine(num_blocks=128).generate(PROMPTS, GREEDY)  # eager, the kernel
    assert cpu_kernel.load() is not None
    monkeypatch.setattr(cpu_kernel, "needs_build", lambda: True)
    engine = _background(make_engine)
    assert engine.runner.kernel_pending and not engine.runner.use_kernel
    assert engine.runner.attention_backend == attention_backends.GATHER
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    for _ in range(3):  # prompts computed and a first decode, eager
        _step(engine, out)
    engine.start_compile()
    assert engine.compile_state == compile_job.COMPILING
    assert engine.stats().compile == compile_job.COMPILING
    _step(engine, out)  # the eager forward keeps serving while the thread compiles
    assert not engine.runner.compiled
    assert engine.compile_job is not None
    engine.compile_job.join(timeout=900)
    assert engine.compile_state == compile_job.READY, engine.compile_job.reason
    before = {rid: len(toks) for rid, toks in out.items()}
    assert all(0 < n < GREEDY.max_tokens for n in before.values())  # mid-flight
    graphs = counters["stats"]["unique_graphs"]
    _step(engine, out)  # swaps first, then steps on the compiled forward
    assert engine.runner.compiled and engine.compile_state == compile_job.COMPILED
    assert engine.runner.use_kernel and not engine.runner.kernel_pending
    while engine.has_work:
        _step(engine, out)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == expected
    # the serving thread found every variant the compile thread compiled: no recompile
    assert counters["stats"]["unique_graphs"] == graphs
    assert engine.stats().compile == compile_job.COMPILED
    assert_all_free(engine)


def _fake_compiled(engine: LLMEngine, forward: Callable[..., Any]) -> None:
    """A stand-in for the compiled forward (a real compile is the test above)."""
    engine.runner.compiled_fn = forward


def _kept_eager(engine: LLMEngine, forward: Callable[..., Any]) -> str:
    """Compile in the background with ``forward`` as the compiled one: the engine keeps
    its eager forward. Returns the job's reason."""
    _fake_compiled(engine, forward)
    engine.start_compile()
    assert engine.compile_job is not None
    engine.compile_job.join(timeout=120)
    assert engine.compile_state == compile_job.EAGER_KEPT
    return engine.compile_job.reason


def test_a_compiled_forward_that_raises_is_not_swapped_in(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = _background(make_engine)

    def raises(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("too many values to unpack (expected 3)")

    assert "ValueError: too many values to unpack" in _kept_eager(engine, raises)
    assert not engine.maybe_swap() and not engine.runner.compiled
    expected = make_engine(num_blocks=128).generate(PROMPTS, GREEDY)
    assert engine.generate(PROMPTS, GREEDY) == expected  # still serving, eager
    assert engine.stats().compile == compile_job.EAGER_KEPT
    assert_all_free(engine)


def test_a_compiled_forward_that_disagrees_is_not_swapped_in(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = _background(make_engine)
    model = engine.runner.model

    def off_by_one(*args: Any, **kwargs: Any) -> Any:
        out = model(*args, **kwargs)
        out.logits = torch.roll(out.logits, 1, dims=-1)  # every argmax moves one id up
        return out

    assert "differ from the eager forward" in _kept_eager(engine, off_by_one)
    assert not engine.maybe_swap() and engine.runner.forward is model
    assert_all_free(engine)


class _Busy:
    """The part of an engine the hold reads: busy until ``until`` (monotonic)."""

    def __init__(self, until: float) -> None:
        self.until = until

    @property
    def has_work(self) -> bool:
        return time.monotonic() < self.until


def test_compile_waits_for_a_quiet_engine() -> None:
    """A worker's compile starts once its engine has had no work for ``quiet_s``, and
    under steady work after ``max_hold_s`` at most (the first requests come first)."""
    busy = compile_job.CompileJob(_Busy(time.monotonic() + 0.3), quiet_s=0.2, max_hold_s=5.0)  # type: ignore[arg-type]
    busy._hold()
    # busy 0.3 s, then quiet 0.2 s (counted from the last poll that saw it busy)
    assert 0.5 - 2 * compile_job.HOLD_POLL_S <= busy.held_s < 3.0, busy.held_s
    steady = compile_job.CompileJob(_Busy(float("inf")), quiet_s=0.2, max_hold_s=0.4)  # type: ignore[arg-type]
    steady._hold()
    assert 0.4 <= steady.held_s < 2.0, steady.held_s
    unheld = compile_job.CompileJob(_Busy(float("inf")))  # type: ignore[arg-type]
    unheld._hold()
    assert unheld.held_s == 0.0
