"""The processes ``bench/stream_overhead.py`` measures: one ``pdserve up --prefill 0`` per code
tree, its router and decode worker found by pid, and their CPU time read from /proc.

A code tree is a directory holding a ``pdserve`` package (a symlink to a checkout's); the
cluster runs with ``PYTHONPATH`` = that directory and its working directory outside any
checkout, so exactly that tree's code is imported (never the repository root, whose
``operator/`` would shadow the standard library).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lib.procfs import descendants

from pdserve.local.proc_group import end_group, start_group
from pdserve.testing.loopback import free_port

ENGINE_THREAD = "pdserve-engine"  # the engine core's thread name (worker/core/main.py)
STARTS = 3  # tries per cluster when a port of its turns out to be another process's


def code_tree(repo: Path, source: str, work: Path) -> tuple[Path, str]:
    """(a directory to put on PYTHONPATH, the commit it runs) for ``source``: a directory
    holding a ``pdserve`` package (a checkout, or a symlink farm like /work/wt-path/X),
    or a git ref of ``repo`` exported with ``git archive``."""
    out = work / re.sub(r"[^A-Za-z0-9_.-]", "_", source)
    out.mkdir(parents=True, exist_ok=True)
    if Path(source).is_dir():
        checkout = (Path(source) / "pdserve").resolve().parent  # the checkout it lives in
        (out / "pdserve").symlink_to(checkout / "pdserve")
        return out, _commit(checkout, "HEAD", dirty_check=True)
    checkout = out / "src"
    checkout.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", source], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(checkout)], input=archive, check=True)
    (out / "pdserve").symlink_to(checkout / "pdserve")
    return out, _commit(repo, source, dirty_check=False)


def _commit(repo: Path, rev: str, dirty_check: bool) -> str:
    got = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", rev], capture_output=True, text=True
    )
    dirty = ""
    if dirty_check:  # tracked files changed since the commit
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "-uno"],
            capture_output=True,
            text=True,
        )
        dirty = "+dirty" if status.stdout.strip() else ""
    return (got.stdout.strip() or "unknown") + dirty


@dataclass
class Up:
    label: str
    url: str
    model: str  # the served model name
    router_pid: int
    worker_pid: int
    engine: tuple[int, int] | None  # (pid, tid) of the engine thread
    proc: subprocess.Popen[str]


def _supports(tree: Path, flag: str) -> bool:
    """Whether the tree's commands take ``flag`` (given quoted, ``'"--name"'``): written out
    in an argparse call (older trees), or as a field of an args dataclass whose flags are
    generated (pdserve/config_cli.py: ``name: type = flag(...)``)."""
    field = flag.strip('"').removeprefix("--").replace("-", "_") + ":"
    package = tree / "pdserve"  # its sub-packages are links to the top-level folders
    folders = [package, *(d for d in package.iterdir() if d.is_dir())]
    for path in (p for d in folders for p in d.glob("*.py")):
        text = path.read_text(errors="ignore")
        if flag in text or any(line.lstrip().startswith(field) for line in text.splitlines()):
            return True
    return False


@contextlib.contextmanager
def pdserve_up(trees: dict[str, Path], model: str, log_dir: Path) -> Iterator[list[Up]]:
    """One ``pdserve up --prefill 0`` per (label, tree), all starting at once, until the
    block exits."""
    procs: list[subprocess.Popen[str]] = []
    # Distinct port bases: clusters starting at once could each see the other's ports free
    # and then race for them.
    bases = random.sample(range(20000, 32000, 200), len(trees) * STARTS)
    try:
        for label, tree in trees.items():
            procs.append(_start(label, tree, model, log_dir, bases.pop()))
        ups = []
        for i, (label, tree) in enumerate(trees.items()):
            for attempt in range(STARTS):
                try:
                    url = _wait_banner(procs[i])
                    break
                except PortTaken:  # another process serves a port of ours: other ports
                    if attempt == STARTS - 1:
                        raise
                    procs[i] = _start(label, tree, model, log_dir, bases.pop())
            router, worker = _children(procs[i].pid)
            ups.append(
                Up(label, url, Path(model).name, router, worker, engine_thread(worker), procs[i])
            )
        yield ups
    finally:
        for proc in procs:
            _stop(proc)


def _start(label: str, tree: Path, model: str, log_dir: Path, base: int) -> subprocess.Popen[str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "up",
        "--prefill",
        "0",
        "--model",
        model,
        "--port",
        str(port),
        "--worker-port-base",
        str(base),
        "--dtype",
        "float32",
        "--log-dir",
        str(log_dir / label),
    ]
    if _supports(tree, '"--enforce-eager"'):  # no compile: the HTTP path is what we measure
        argv.append("--worker-arg=--enforce-eager")
    # One torch thread in both trees, named here rather than left to the start-up thread
    # probe: a lone worker's probe can pick all cores in one cluster and one in the other
    # (it times GEMMs on a loaded host), and an OpenMP helper thread's compute (and spin)
    # is not the engine thread's, so it landed in "worker_http" (a 6.7x ratio between two
    # identical trees in CI).
    if _supports(tree, '"--cpu-threads"'):
        argv.append("--worker-arg=--cpu-threads=1")
    # Each core a child of its worker (the tree's CPU is the worker's descendants), and
    # from the tree's own code: no zygote, neither the cluster's nor a caller's.
    if _supports(tree, '"--core-zygote"'):
        argv.append("--no-core-zygote")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("PDSERVE_CORE_ZYGOTE", None)
    cwd = tempfile.mkdtemp(prefix="stream-overhead-")  # outside any checkout
    return start_group(argv, env=env, cwd=cwd)


def _stop(proc: subprocess.Popen[str]) -> None:
    end_group(proc, signal.SIGINT)


def _wait_banner(proc: subprocess.Popen[str], timeout: float = 600.0) -> str:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while not any(line.startswith("pdserve is up") for line in lines):
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            error = PortTaken if "not ours" in "".join(lines) else RuntimeError
            raise error("pdserve up exited:\n" + "".join(lines))
        lines.append(line)
        if time.monotonic() > deadline:
            raise RuntimeError("pdserve up not ready:\n" + "".join(lines))
    found = re.search(r"pdserve is up: (\S+)/v1", "".join(lines))
    assert found is not None
    return found.group(1)


def _children(pid: int) -> tuple[int, int]:
    """(router pid, decode worker pid) among ``pdserve up``'s children."""
    router = worker = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"router" in cmd:
                router = int(child)
            elif b"decode-worker" in cmd:
                worker = int(child)
    assert router and worker, f"router {router}, decode worker {worker} under pid {pid}"
    return router, worker


class PortTaken(RuntimeError):
    """``pdserve up`` found one of its ports served by a process not its own."""


def engine_thread(pid: int) -> tuple[int, int] | None:
    """(pid, tid) of the engine thread in ``pid`` or a child (the engine core process):
    by its OS name when set, else from ``py-spy dump`` (Python 3.11 does not name OS
    threads); None when neither can tell."""
    procs = descendants(pid)
    for p in procs:
        for task in Path(f"/proc/{p}/task").iterdir():
            if (task / "comm").read_text().strip() == ENGINE_THREAD:
                return p, int(task.name)
    spy = Path(sys.executable).with_name("py-spy")
    for p in procs:
        try:
            out = subprocess.run(
                [str(spy), "dump", "--pid", str(p)], capture_output=True, text=True, timeout=30
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return None
        found = re.search(rf'^Thread (\d+) \(\w+\): "{ENGINE_THREAD}"', out, re.M)
        if found:
            return p, int(found.group(1))
    return None
