"""The start-up probe (engine/startup_probe.py) and a step that raises at run time
(engine/step_fault.py), with a fault injected into the tiny Llama's MLP: the model loads
and answers its one-token load check, then raises at its Nth MLP call, as the PhiMoE of
issue #48 did in decode (``ValueError: too many values to unpack``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from engine_helpers import assert_all_free

from pdserve.engine import startup_probe, step_fault
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

MESSAGE = "too many values to unpack (expected 3)"


class Fault:
    """Layer 0's MLP raises from its ``at``-th call on (None: never)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls, self.at = 0, None
        mlp = engine.runner.model.model.layers[0].mlp
        forward = mlp.forward

        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.at is not None and self.calls >= self.at:
                raise ValueError(MESSAGE)
            return forward(*args, **kwargs)

        mlp.forward = faulty


@pytest.fixture
def faulty(make_engine: Callable[..., LLMEngine]) -> Iterator[tuple[LLMEngine, Fault]]:
    engine = make_engine(num_blocks=64)
    yield engine, Fault(engine)


def test_probe_runs_prefill_and_batched_decode(faulty: tuple[LLMEngine, Fault]) -> None:
    engine, fault = faulty
    tokens = startup_probe.check(engine)
    n = len(startup_probe.BATCH_LENS)
    assert [len(t) for t in tokens] == [1] + [startup_probe.DECODE_STEPS + 1] * n
    # a prefill step, a prefill step for the batch, then DECODE_STEPS decodes at batch n
    assert fault.calls >= 2 + startup_probe.DECODE_STEPS
    stats = engine.stats()  # nothing left behind
    assert (stats.prompt_tokens, stats.generation_tokens) == (0, 0)
    assert_all_free(engine)


def test_probe_with_a_hand_off_holds_then_releases(faulty: tuple[LLMEngine, Fault]) -> None:
    engine, _ = faulty
    assert startup_probe.check(engine, hand_off=True) == startup_probe.check(engine)
    assert_all_free(engine)


@pytest.mark.parametrize("at", [1, 4])  # the first prefill; a decode step at batch 3
def test_probe_refuses_a_model_that_raises(faulty: tuple[LLMEngine, Fault], at: int) -> None:
    engine, fault = faulty
    fault.at = at
    with pytest.raises(startup_probe.ProbeFailed) as info:
        startup_probe.check(engine)
    text = str(info.value)
    assert f"model {engine.served_model_name!r} refused at start" in text
    assert f"ValueError: {MESSAGE}" in text
    assert_all_free(engine)


def test_a_step_that_raises_faults_the_engine_until_its_probe_passes(
    faulty: tuple[LLMEngine, Fault], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, fault = faulty
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [9] * 11, params)
    assert step_fault.step_or_fail(engine)  # the prompts: fine
    fault.at = fault.calls + 1
    outs = step_fault.step_or_fail(engine)  # a decode step raises
    assert {o.request_id for o in outs} == {"a", "b"} and all(o.error for o in outs)
    assert engine.step_failures == 1
    assert engine.fault == f"model {engine.served_model_name!r}: ValueError: {MESSAGE}"
    assert engine.stats().fault == engine.fault and engine.stats().step_failures == 1
    assert_all_free(engine)
    step_fault.retry_probe(engine)  # too soon: not retried
    assert engine.fault and fault.calls == fault.at
    monkeypatch.setattr(step_fault, "RETRY_S", 0.0)
    step_fault.retry_probe(engine)  # the probe raises too: the fault stands
    assert engine.fault and fault.calls > fault.at
    assert_all_free(engine)
    fault.at = None  # a transient fault: the next probe passes and clears it
    step_fault.retry_probe(engine)
    assert not engine.fault and engine.stats().fault == ""
    assert engine.step_failures == 1
    assert_all_free(engine)
