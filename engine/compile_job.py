"""The compiled forward, built in the background while the eager one serves.

A worker reports ready as soon as its model is loaded and its start-up probe passed on
the eager forward (startup_probe.py); ``torch.compile`` then runs on a thread of its own
(``pdserve-compile``). The thread works on a *shadow* engine: the same model (the same
module, so the same weights and the same compiled code objects), its own small KV pool,
scheduler and sampler, so nothing it does touches the serving engine's requests or
blocks. Attention's per-step state (``attention.CURRENT``) is per thread.

1. The probe on the shadow's eager forward: the tokens to agree with.
2. Every graph variant (compiled.WARM_UP) on the compiled forward: traced and compiled,
   or loaded from the cache.
3. The probe again on the compiled forward. It must not raise and must give the same
   greedy tokens as the eager one; otherwise the worker keeps the eager forward, says
   why (a warning naming the model and the exception, ``compile`` = ``eager-kept`` on
   ``/health``, ``pdserve_engine_compile_state``).

Then the serving thread swaps: ``maybe_swap`` (called between steps, by the engine's
step and the core loop's idle turns) sets the runner's forward. The compiled forward
runs the same model on the same pool as the eager one, so a request in flight carries on
across the swap: its KV is the pool's, whichever forward wrote it.

Dynamo's frame hook is per thread: the serving thread's eager calls are not traced while
the compile thread traces, and once swapped, its calls find the variants the compile
thread compiled (no recompile; tests/engine/test_compile_swap.py counts the graphs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine import compiled, startup_probe
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine_view import EngineView

logger = logging.getLogger(__name__)

# compile states, as /health and pdserve_engine_compile_state name them
OFF = "off"  # --enforce-eager, LoRA adapters, or no compile wanted
COMPILING = "compiling"  # the eager forward serves; the compile thread runs
READY = "ready"  # compiled and checked: swapped in at the next turn of the serving loop
COMPILED = "compiled"  # the compiled forward serves
EAGER_KEPT = "eager-kept"  # the compile raised or disagreed with eager: eager stays
STATES = (OFF, COMPILING, READY, COMPILED, EAGER_KEPT)
NICE = 10  # the compile thread's niceness (Linux: per thread)
# A worker's compile starts once its engine has had no work for QUIET_S, or MAX_HOLD_S
# after ready under steady traffic (worker/core/main.py). Niceness does not keep it off
# the serving path: each core is a session of its own, so a CFS autogroup of its own, and
# niceness counts only inside a group; and the compile thread's Python holds the GIL the
# eager forward needs between its ops. A warm start's compile (inductor's imports, then
# the cached graphs) took ~2-3.5 CPU-s per core in the seconds after ready, measured on
# the 2-core dev machine, beside the first answer.
QUIET_S = 2.0
MAX_HOLD_S = 10.0
HOLD_POLL_S = 0.05


def run_variants(engine: EngineView, log: Callable[[str], None]) -> None:
    """One generation per graph variant (compiled.WARM_UP) on ``engine``'s forward."""
    for i, (label, prompts, max_tokens) in enumerate(compiled.WARM_UP, 1):
        t = time.perf_counter()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.generate(prompts, params)
        log(f"  [{i}/{len(compiled.WARM_UP)}] {label}: {time.perf_counter() - t:.1f}s")


def warm_up(engine: EngineView) -> float:
    """Compile every graph variant now, on the engine's own thread; returns seconds
    (``--compile-before-ready``, and in-process engines; a worker by default compiles in
    the background: CompileJob below).

    Each variant prints a progress line: the first start compiles (a minute or more on a
    small CPU), later starts load the cache.
    """
    start = time.perf_counter()
    compiled.say(
        f"compiling the model forward (torch.compile; cache {compiled.cache_dir()}; "
        "--enforce-eager skips this)"
    )
    try:
        run_variants(engine, compiled.say)
    except Exception:  # no compiler, no Triton, an inductor bug: serve eager
        logger.exception("torch.compile failed; this worker runs the eager forward")
        for request_id in list(engine.requests):
            engine.abort(request_id)
        engine.runner.use_eager()
    else:
        compiled.in_service()
    engine.forget_warm_up()
    return time.perf_counter() - start


class CompileJob:
    def __init__(self, engine: EngineView, quiet_s: float = 0.0, max_hold_s: float = 0.0) -> None:
        self.engine = engine
        self.quiet_s, self.max_hold_s = quiet_s, max_hold_s
        self.held_s = 0.0  # how long it waited for a quiet engine
        self.state = COMPILING
        self.reason = ""  # EAGER_KEPT: why
        self.started = time.monotonic()
        self.seconds = 0.0  # from start to READY or EAGER_KEPT
        self.kernel = False  # the CPU attention kernel was built here (swapped in too)
        self._thread = threading.Thread(target=self._run, name="pdserve-compile", daemon=True)

    def start(self) -> None:
        compiled.say(
            f"compiling the model forward in the background (torch.compile; cache "
            f"{compiled.cache_dir()}); the eager forward serves meanwhile"
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _hold(self) -> None:
        """Wait until the engine has had no work for ``quiet_s`` (at most ``max_hold_s``
        after the job started). ``has_work`` is read from this thread: a stale answer only
        moves the start by a poll."""
        if self.quiet_s <= 0:
            return
        deadline = self.started + self.max_hold_s
        idle_since = time.monotonic()
        while (now := time.monotonic()) < deadline:
            if self.engine.has_work:
                idle_since = now
            elif now - idle_since >= self.quiet_s:
                break
            time.sleep(HOLD_POLL_S)
        self.held_s = time.monotonic() - self.started

    def _run(self) -> None:
        # Below the serving thread (and the compilers inductor starts from here inherit
        # it): on a small CPU the first requests, served eager, come first.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        self._hold()
        if self.held_s >= HOLD_POLL_S:
            compiled.say(
                f"compile starts {self.held_s:.1f}s after ready (waited for a quiet engine)"
            )
        runner = self.engine.runner
        model = self.engine.served_model_name
        try:
            shadow = self.engine.shadow()
            if runner.kernel_pending:  # first start: the kernel is built here, then used
                self.kernel = _build_kernel()
                if self.kernel:
                    shadow.runner.use_kernel_backend()
            expected = startup_probe.run(shadow)
            shadow.runner.forward = runner.ensure_compiled_fn()
            run_variants(shadow, compiled.say)
            got = startup_probe.run(shadow)
            if got != expected:
                raise startup_probe.ProbeFailed(
                    f"the compiled forward's greedy tokens differ from the eager forward's: "
                    f"{got} != {expected}"
                )
        except Exception as exc:
            self.reason = f"{type(exc).__name__}: {exc}"
            self.state = EAGER_KEPT
            logger.warning(
                "model %s: the compiled forward failed its check; this worker keeps "
                "the eager forward (%s)",
                model,
                self.reason,
                exc_info=True,
            )
        else:
            self.state = READY
        self.seconds = time.monotonic() - self.started

    def maybe_swap(self) -> bool:
        """On the serving thread, between steps: the compiled forward serves from now on if
        it is ready (True once swapped)."""
        if self.state != READY:
            return False
        runner = self.engine.runner
        if runner.eager_only or runner.compiled_fn is None:  # LoRA came meanwhile
            self.state, self.reason = EAGER_KEPT, runner.eager_only
            return False
        runner.forward = runner.compiled_fn
        if self.kernel:
            runner.use_kernel_backend()
        compiled.in_service()
        self.state = COMPILED
        compiled.say(
            f"compiled forward in service ({self.seconds:.1f}s after start; "
            "swapped from eager between steps)"
        )
        return True


def _build_kernel() -> bool:
    from pdserve.engine import cpu_kernel

    started = time.monotonic()
    compiled.say(
        "building the CPU attention kernel (first start; the gather path serves meanwhile)"
    )
    built = cpu_kernel.load() is not None
    compiled.say(
        f"CPU attention kernel {'built' if built else 'not built'} in "
        f"{time.monotonic() - started:.1f}s"
    )
    return built
