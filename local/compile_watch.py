"""``pdserve up``'s console while the workers compile in the background.

Workers are ready (and serving, eager) before their compiled forward is
(engine/compile_job.py). This thread polls each worker's ``/health`` (its ``compile``
field) and prints every change on the console, until each worker's forward is settled:
``compiled``, ``eager-kept`` (its log says why) or ``off``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from pdserve.local.processes import Proc

SETTLED = frozenset({"compiled", "eager-kept", "off"})
SAY = {
    "compiling": "compiling the forward in the background (serving with the eager one)",
    "ready": "compiled forward checked against the eager one; swapping it in",
    "compiled": "compiled forward in service",
    "eager-kept": "compiled forward failed its check: the eager forward stays (log {log})",
}


class CompileWatch:
    def __init__(
        self, workers: list[Proc], interval_s: float = 1.0, say: Callable[[str], None] = print
    ) -> None:
        self.workers = workers
        self.interval_s, self.give_up_s = interval_s, 3600.0
        self.say = say
        self.states: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="compile-watch", daemon=True)

    def start(self) -> CompileWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        started = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(self.interval_s):
                for proc in self.workers:
                    self._check(client, proc, time.monotonic() - started)
                settled = [self.states.get(p.name) in SETTLED for p in self.workers]
                if all(settled) or time.monotonic() - started > self.give_up_s:
                    return

    def _check(self, client: httpx.Client, proc: Proc, seconds: float) -> None:
        try:
            state = str(client.get(proc.url + "/health").json().get("compile", ""))
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if not state or state == self.states.get(proc.name):
            return
        self.states[proc.name] = state
        if state in SAY:
            text = SAY[state].format(log=proc.log_path)
            self.say(f"  {proc.name:<10} {text} (+{seconds:.0f}s)")
