"""Supervision of ``pdserve up``'s processes, as a kubelet does it for a pod's containers.

A process that exits is restarted in place (same name, ports and arguments) after a
back-off that doubles with each crash in a row (1 s, 2 s, 4 s ... capped at 30 s) and
starts over once a process has run for a minute: a worker that crashes at start-up
does not spin, one that crashes once a day restarts at once. Meanwhile the router
routes around it: its health checks drop the dead worker and re-admit it when it
answers again. Only Ctrl-C / SIGTERM stop ``up``; a dead process never does.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.local.processes import LocalCluster, Proc


@dataclass
class _Backoff:
    started: float  # when the current incarnation started (monotonic)
    crashes: int = 0  # crashes in a row (reset by a long enough run)
    due: float | None = None  # restart time once a crash has been seen


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Supervisor:
    def __init__(
        self,
        cluster: LocalCluster,
        base_s: float = 1.0,
        max_s: float = 30.0,
        reset_after_s: float = 60.0,
        say: Callable[[str], None] = _stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.base_s, self.max_s, self.reset_after_s = base_s, max_s, reset_after_s
        self.say = say
        self.clock = clock
        self._state: dict[str, _Backoff] = {}
        self.restarts: dict[str, int] = {}  # name -> restarts so far (for tests and logs)

    def delay(self, crashes: int) -> float:
        """Back-off before the restart that follows crash number ``crashes`` (1, 2, ...)."""
        return min(self.base_s * 2 ** max(crashes - 1, 0), self.max_s)

    def tick(self) -> list[Proc]:
        """Notice exits, restart those whose back-off is over; returns the restarted."""
        now, restarted = self.clock(), []
        for proc in self.cluster.dead():
            st = self._state.setdefault(proc.name, _Backoff(started=now))
            if st.due is None:
                st.crashes = 1 if now - st.started >= self.reset_after_s else st.crashes + 1
                st.due = now + self.delay(st.crashes)
                code = proc.popen.returncode if proc.popen is not None else "?"
                wait = st.due - now
                self.say(
                    f"pdserve up: {proc.name} exited ({code}); restarting in {wait:.0f}s; "
                    f"log {proc.log_path}:\n{proc.log_tail(10)}"
                )
            elif now >= st.due:
                self.cluster.restart(proc)
                st.started, st.due = now, None
                self.restarts[proc.name] = self.restarts.get(proc.name, 0) + 1
                self.say(
                    f"pdserve up: restarted {proc.name} at {proc.url} "
                    f"(restart {self.restarts[proc.name]})"
                )
                restarted.append(proc)
        return restarted

    def run_forever(self, interval_s: float = 0.5) -> None:
        """Supervise until interrupted (KeyboardInterrupt from the signal handler)."""
        while True:
            self.tick()
            time.sleep(interval_s)
