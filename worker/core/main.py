"""The engine core's process: ``python -m pdserve.worker.core.main COMMANDS RESULTS``.

Started by :class:`~pdserve.worker.core.client.EngineClient`, never by hand. It
connects to the front end's two sockets, reads ``("init", config)`` (a
:class:`~pdserve.worker.core.config.CoreConfig`), builds the role's core (the engine
and what touches its KV pool: worker/core/decode.py, worker/core/prefill.py), runs the
start-up probe (engine/startup_probe.py), answers ``("ready", info)`` (or ``("failed",
why)``), starts the background compile (engine/compile_job.py) and runs
:class:`~pdserve.worker.core.loop.CoreLoop` until told to stop. It dies with its front
end (``PR_SET_PDEATHSIG``): an orphaned core would hold its ports and memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import pickle
import signal
import sys
import time
import traceback
from typing import Any, Protocol

import zmq

from pdserve.engine import compile_job, startup_probe
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.os_thread import name_os_thread
from pdserve.protocol.hashing import note_key_source
from pdserve.worker.core.config import CoreConfig
from pdserve.worker.core.loop import CoreLoop, Hook, Query

GIL_SWITCH_INTERVAL_S = 0.0005
ENGINE_NAME = "pdserve-engine"  # the core's OS thread name (benches find it by this)
_PR_SET_PDEATHSIG = 1


class WorkerCore(Protocol):
    engine: LLMEngine
    hooks: list[Hook]
    queries: dict[str, Query]

    def info(self) -> dict[str, Any]: ...
    def probe_transfer(self, handles: list[Any]) -> None: ...
    def close(self) -> None: ...


def build_core(config: CoreConfig) -> WorkerCore:
    if config.role == "decode":
        from pdserve.worker.core.decode import DecodeCore

        return DecodeCore(config)
    if config.role == "prefill":
        from pdserve.worker.core.prefill import PrefillCore

        return PrefillCore(config)
    raise ValueError(f"unknown worker role {config.role!r}")


def probe(core: WorkerCore, role: str) -> None:
    """The serving path once (prefill, the role's KV hand-off over its own transfer
    classes, batched decode) on the forward that serves first: a model or a transport
    that raises is refused now (``ProbeFailed``), not after the worker said ready."""
    core.engine.hands_off = role == "prefill"
    startup_probe.check(core.engine, hand_off=core.engine.hands_off, transfer=core.probe_transfer)


def die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the thread that started it exits."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def main(argv: list[str]) -> int:
    die_with_parent(os.getppid())
    # The front end decides when this ends ("stop", or its death): a Ctrl-C or a
    # SIGTERM to the process group must not cut a step short under open streams.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    results = ctx.socket(zmq.PUSH)
    for sock, addr in ((commands, argv[0]), (results, argv[1])):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(addr)
    kind, config = pickle.loads(commands.recv())
    assert kind == "init" and isinstance(config, CoreConfig), kind
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    note_key_source()  # a Secret without hash-key: said once (protocol/hashing.py)
    try:
        started = time.monotonic()
        core = build_core(config)
        engine = core.engine
        probe(core, config.role)
    except startup_probe.ProbeFailed as exc:
        logging.getLogger(__name__).error("%s", exc, exc_info=True)
        results.send(pickle.dumps(("failed", str(exc))))
        return 1
    except BaseException:
        results.send(pickle.dumps(("failed", traceback.format_exc())))
        return 1
    # Named before "ready": whoever sees the worker healthy finds the engine thread by name.
    name_os_thread(ENGINE_NAME)
    fwd = "compiled" if engine.runner.compiled else "eager"
    # CPU-s since the fork (or the process's start): a loaded machine's wall says little
    print(
        f"engine core: model {engine.served_model_name!r} loaded and probed in "
        f"{time.monotonic() - started:.1f}s, {time.process_time():.1f} CPU-s since the "
        f"core's start (serving with the {fwd} forward)",
        file=sys.stderr,
        flush=True,
    )
    results.send(pickle.dumps(("ready", core.info())))
    # In the background: readiness does not wait for it, and it waits for a quiet engine
    # so that the first requests have the CPU (compile_job.QUIET_S).
    engine.start_compile(compile_job.QUIET_S, compile_job.MAX_HOLD_S)
    # The model, torch and the engine's tables stay alive for good: keep them out of
    # the collector's full passes.
    gc.collect()
    gc.freeze()
    # The step takes the GIL back after every torch op; the core's other threads (KV
    # transfers, the lease side channel) hold it for up to the switch interval each time.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    loop = CoreLoop(core.engine, commands, results, core.hooks, core.queries)
    try:
        loop.run()
    finally:
        core.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
