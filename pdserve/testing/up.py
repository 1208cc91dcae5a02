"""``pdserve up`` started as a user starts it, for tests and benches: its banner read, and
the cluster it printed (router URL, worker URLs) once it is up.

    with running_up(model, "--prefill", "1", "--decode", "2") as up:
        httpx.post(up.url + "/v1/completions", ...)
        all_kv_free(up.workers)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pdserve import env
from pdserve.local.proc_group import end_group, start_group
from pdserve.testing.loopback import free_port, worker_port_base

ROOT = Path(__file__).resolve().parents[2]  # the checkout: pdserve/testing/ -> root
BANNER = "pdserve is up"
LOGS_IN = r"\(logs in (\S+)\)"


@dataclass
class Up:
    """A running ``pdserve up``; a thread keeps reading its output into ``lines``."""

    proc: subprocess.Popen[str]
    url: str = ""  # the router, without /v1
    named: dict[str, str] = field(default_factory=dict)  # worker name (decode-0) -> URL
    lines: list[str] = field(default_factory=list)
    ready_s: float = 0.0  # seconds from launch to the banner

    @property
    def workers(self) -> list[str]:
        """Every worker URL, in the banner's order."""
        return list(self.named.values())

    def urls(self, role: str) -> list[str]:
        return [u for n, u in self.named.items() if n.startswith(role)]

    @property
    def log_dir(self) -> str:
        """Where up writes each process's log (its banner says; "" if it did not)."""
        found = re.search(LOGS_IN, "".join(self.lines))
        return found.group(1) if found else ""


def port_base() -> tuple[str, str]:
    """``--worker-port-base`` of a block this process reserved (pdserve.testing.loopback),
    away from the default 8100/8200 other loopback tests start from."""
    return ("--worker-port-base", str(worker_port_base()))


def suite_flags(log_dir: Path, max_model_len: int = 1024) -> list[str]:
    """The flags of a suite's ``pdserve up``: the test transport ($PDSERVE_TEST_TRANSPORT,
    default nixl), its logs in ``log_dir``, worker ports of its own (``port_base``), a
    short context."""
    return [
        *("--kv-transport", os.environ.get(env.TEST_TRANSPORT, "nixl")),
        *("--log-dir", str(log_dir), *port_base()),
        f"--worker-arg=--max-model-len={max_model_len}",
    ]


def start_up(
    model: str | Path | None,
    *flags: str,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
    preexec_fn: Callable[[], object] | None = None,
) -> Up:
    """``python -m pdserve up --model MODEL FLAGS`` in its own session, from the checkout (no
    ``--model`` for None: up's default model; a free port unless FLAGS name one); returns
    once its banner is out. If it exits or is not up in ``timeout`` seconds, it is stopped
    and AssertionError names why, with its output and its processes' log tails."""
    port = () if "--port" in flags else ("--port", str(free_port()))
    named = ("--model", str(model)) if model is not None else ()
    argv = [sys.executable, "-m", "pdserve", "up", *named, *port, *flags]
    started = time.monotonic()
    proc = start_group(argv, env=env, cwd=ROOT, preexec_fn=preexec_fn)
    up = Up(proc)
    banner = threading.Event()

    def read(out: IO[str]) -> None:  # to the end: a pipe nobody drains stops `up` once full
        for line in out:
            up.lines.append(line)
            if line.startswith(BANNER) and not banner.is_set():
                up.ready_s = time.monotonic() - started
                banner.set()
        banner.set()  # end of output: up exited

    assert proc.stdout is not None
    threading.Thread(target=read, args=(proc.stdout,), daemon=True, name="up-output").start()
    banner.wait(timeout)
    text = "".join(up.lines)
    if BANNER not in text:
        why = "exited" if proc.poll() is not None else f"not up within {timeout:g}s"
        end_group(proc, grace_s=10)
        raise AssertionError(f"pdserve up {why}:\n{text}{log_tails(text)}")
    up.named = dict(re.findall(r"((?:prefill|decode)-\d+)\s+ready at (\S+)", text))
    up.url = re.search(rf"{BANNER}: (\S+)/v1", text).group(1)  # type: ignore[union-attr]
    return up


@contextlib.contextmanager
def running_up(
    model: str | Path | None,
    *flags: str,
    stop: int = signal.SIGINT,
    grace_s: float = 30,
    **start: Any,
) -> Iterator[Up]:
    """``start_up`` (its keywords: ``start``), stopped with ``stop`` (SIGINT: as Ctrl-C)
    when the block ends."""
    up = start_up(model, *flags, **start)
    try:
        yield up
    finally:
        end_group(up.proc, stop, grace_s=grace_s)


def log_tails(up_output: str, lines: int = 15) -> str:
    """The last ``lines`` of each process log in the directory ``pdserve up`` named."""
    found = re.search(LOGS_IN, up_output)
    if found is None:
        return ""
    out = []
    for path in sorted(Path(found.group(1)).glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"\n--- {path.name} (last {lines} lines)\n" + "\n".join(tail))
    return "".join(out)
