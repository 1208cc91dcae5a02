"""Session services stopped right after their last test, not at the end of the run.

A session-scoped service (the shared ``pdserve up``, the edge deployment, the k8s_real
control plane and its operator) is torn down by pytest only when the whole session ends:
under ``make test`` that is after every other group its xdist worker runs, and an idle
service is not free (health checks every 0.2-1 s, engine cores polling, the API server's
controllers: ~0.15 CPU-s a second for the three, measured with /proc at load ~12). A
fixture that enters its service through :func:`released_after_last_user` is stopped once
the last test of this process's run that uses it has torn down; the fixture's own
teardown then finds it stopped. The run's order is ``session.items`` (tests/xdist_plan.py
keeps a group's tests together and in that order on one xdist worker), so a service is
never stopped before a test that needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest


class Releaser:
    """The services of one pytest process (:data:`SESSION`; a test makes its own)."""

    def __init__(self) -> None:
        self.closers: list[tuple[str, Callable[[], None]]] = []  # (fixture, close), by start
        self.last_user: dict[str, str] = {}  # fixture -> node id of the last test using it
        self.done: dict[str, str] = {}  # fixture -> its last test's module, once that ran

    @contextlib.contextmanager
    def released_after_last_user(self, fixture: str) -> Iterator[contextlib.ExitStack]:
        """An exit stack for the service of session fixture ``fixture``: closed after the
        fixture's last test, or at the fixture's teardown, whichever comes first."""
        with contextlib.ExitStack() as stack:
            entry = (fixture, stack.close)
            self.closers.append(entry)
            try:
                yield stack
            finally:
                if entry in self.closers:
                    self.closers.remove(entry)

    def plan(self, items: list[pytest.Item]) -> None:
        """Record, for every fixture, the last test of the run that uses it."""
        self.last_user = {}
        self.done = {}
        for item in items:
            for name in getattr(item, "fixturenames", ()):
                self.last_user[name] = item.nodeid

    def after_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """Stop the services whose last user has run, once its module's fixtures (which
        may use the service in their teardown) are torn down too: when the next test is in
        another module. The latest started goes first (a service started on top of
        another)."""
        started = {fixture for fixture, _ in self.closers}
        for name in started.intersection(getattr(item, "fixturenames", ())):
            if self.last_user.get(name) == item.nodeid:
                self.done[name] = str(item.path)
        if not self.done or (nextitem is not None and str(nextitem.path) in self.done.values()):
            return  # none finished, or the module of a finished one's last test goes on
        for entry in reversed(list(self.closers)):
            fixture, close = entry
            if fixture in self.done:
                self.closers.remove(entry)
                close()
        self.done = {}


SESSION = Releaser()
released_after_last_user = SESSION.released_after_last_user
