"""Abandoned grammar compiles, bounded (issue 44).

xgrammar cannot be interrupted: a compile past ``--grammar-compile-timeout`` is refused
and left to finish on its own thread, while later compiles go to a fresh one. Unbounded,
one key sending schema after pathological schema would pile up CPU- and memory-hungry
threads in every engine core. So the core loop keeps them here:

- at most ``bound`` abandoned compiles run at once per core; while that many run, no new
  compile starts (queued grammars wait for one to finish, the engine steps on);
- the tenant (the router's key salt) whose compile was abandoned is backed off: its
  grammar requests are refused at once while its abandoned compile still runs and for
  ``backoff_s`` after the timeout, so one key cannot fill the bound again and again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

DEFAULT_BOUND = 2
DEFAULT_BACKOFF_S = 60.0


class AbandonedCompiles:
    def __init__(
        self,
        bound: int = DEFAULT_BOUND,
        backoff_s: float = DEFAULT_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound = bound
        self.backoff_s = backoff_s
        self._clock = clock
        self._running: list[tuple[str, Future[Any]]] = []
        self._until: dict[str, float] = {}
        self.refused = 0  # grammar requests refused while their key was backed off

    def add(self, tenant: str, future: Future[Any]) -> None:
        """``tenant``'s compile timed out and runs on, abandoned."""
        self._running.append((tenant, future))
        self._until[tenant] = self._clock() + self.backoff_s

    def running(self) -> int:
        self._running = [(t, f) for t, f in self._running if not f.done()]
        return len(self._running)

    def full(self) -> bool:
        """No new compile may start: ``bound`` abandoned ones still run."""
        return self.running() >= self.bound

    def backing_off(self, tenant: str) -> bool:
        """Whether ``tenant``'s grammar requests are refused now."""
        now = self._clock()
        self._until = {t: u for t, u in self._until.items() if u > now}
        self.running()
        return tenant in self._until or any(t == tenant for t, _ in self._running)

    def refusal(self, field: str) -> str:
        self.refused += 1
        return (
            f"{field}: a grammar of this API key did not compile within the time limit "
            f"and is still compiling; grammar requests of this key are refused for up "
            f"to {self.backoff_s:g} s"
        )
