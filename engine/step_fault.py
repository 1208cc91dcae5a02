"""A step that raises at run time: the worker takes itself out of service, visibly.

The running requests fail with an error line (the router migrates or answers them), and
the engine is *faulted*: ``LLMEngine.fault`` names the model and the exception, the
worker's ``/health`` turns 503 with it (the router stops routing there; a Kubernetes pod
turns unready), ``pdserve_engine_step_failures_total`` counts it and an error line in
the log names the model. A faulted engine that is idle re-runs the start-up probe
(startup_probe.py) every ``RETRY_S``: if the probe passes the fault is cleared (a
transient failure), else it stands, with the probe's exception as the reason.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from pdserve.engine import startup_probe

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.protocol.outputs import RequestOutput

logger = logging.getLogger(__name__)
RETRY_S = 10.0  # a faulted, idle engine re-runs its probe this often


def step_or_fail(engine: LLMEngine) -> list[RequestOutput]:
    """One engine step's outputs; if the step raises, every unfinished request fails and
    the engine is faulted."""
    try:
        return engine.step()
    except Exception as exc:
        engine.step_failures += 1
        engine.fault = f"model {engine.served_model_name!r}: {type(exc).__name__}: {exc}"
        engine.fault_at = time.monotonic()
        logger.exception(
            "engine step failed (%s); failing the running requests; this worker "
            "is unready until its probe passes again",
            engine.fault,
        )
        return engine.fail_all(f"engine error: {exc}")


def retry_probe(engine: LLMEngine) -> None:
    """A faulted engine with nothing to do re-runs its probe once ``RETRY_S`` has passed."""
    if not engine.fault or engine.has_work or time.monotonic() - engine.fault_at < RETRY_S:
        return
    try:
        startup_probe.run(engine, hand_off=engine.hands_off)
    except Exception as exc:
        engine.fault = f"model {engine.served_model_name!r}: {type(exc).__name__}: {exc}"
        engine.fault_at = time.monotonic()
        logger.error("engine still faulted: its probe raised (%s)", engine.fault)
    else:
        logger.warning("engine probe passed again: the fault is cleared (%s)", engine.fault)
        engine.fault = ""
