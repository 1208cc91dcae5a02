"""A zygote for engine cores: one process that has imported the engine forks a core for
each worker that asks, so a cluster's cores do not each import torch and transformers.

A core's start is mostly imports: ~6 CPU-s on the 2-core dev machine, ~4.5 of them
transformers' modeling stack, where loading the tiny model takes well under one. ``pdserve
up`` runs one zygote per cluster (``--no-core-zygote``: none) and passes its socket to the
workers in ``PDSERVE_CORE_ZYGOTE``; a worker without it (a Kubernetes pod) starts its core
as a plain process, as does one the zygote refuses or cannot be reached by.

The exchange, over an ``AF_UNIX`` stream socket in a private (0700) directory:

- the worker sends one request, ``{"argv": [...], "env": {...}, "cwd": ...}`` as JSON after
  a 4-byte length, with its stdin, stdout and stderr attached (``SCM_RIGHTS``);
- the zygote forks and answers ``{"pid": N}`` (or ``{"refused": why}``), then
  ``{"returncode": R}`` when the core exits (``Popen``'s convention: ``-N`` for signal N).

The connection is the core's lifeline: when the worker's end closes (it exited or died, or
:meth:`ForkedCore.kill` half-closed it) the zygote kills the core, as ``PR_SET_PDEATHSIG``
does for a core that is the worker's own child. A core dies with the zygote (core_main
sets that up with its parent, which is then the zygote), and the zygote with the process
that started it (``--stdin-lifeline``: EOF on its stdin, a pipe from that process).

Each core runs in a session of its own (its own CFS autogroup where the kernel groups by
session), not in the zygote's. The imports have read the environment already (OpenMP's
thread count when torch's library loads, the Hugging Face offline flags), so a request whose
environment differs from the zygote's in a key outside ``RUNTIME_KEYS`` is refused, naming
the keys. The zygote forks only from its one thread of Python (a selector loop; ``SIGCHLD``
arrives as a wakeup byte).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from pdserve import env

logger = logging.getLogger(__name__)

# Read after the fork (by pdserve.env at run time, or by nothing that runs before it):
# requests may differ from the zygote here. COLUMNS and LINES: a terminal's size (pytest
# sets them), read when something is printed. _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR:
# inductor writes it into its own process's environment before each compiled C++ module
# loads (torch/_inductor/codecache.py), so a process that compiled passes a stale one on.
# TORCH_CUSTOM_PYTHONPATH: set by engine/compiled.py before a compile and read only by the
# compile's ISA probe child, so a caller that compiled in-process passes it on.
RUNTIME_PREFIXES = ("PDSERVE_", "PYTEST_")
RUNTIME_KEYS = frozenset(
    {
        "PYTHONUNBUFFERED",
        "COLUMNS",
        "LINES",
        "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
        "TORCH_CUSTOM_PYTHONPATH",
    }
)
# What a core imports, done once here (the roles' cores, and what core_main imports).
PRELOAD = ("pdserve.worker.core.main", "pdserve.worker.core.decode", "pdserve.worker.core.prefill")
MAX_REQUEST = 1 << 20
ANSWER_TIMEOUT_S = 300.0  # a zygote still importing answers once it is done


class ZygoteRefused(RuntimeError):
    pass


# -- the worker's side -----------------------------------------------------------------


class ForkedCore:
    """A core forked by the zygote: the part of ``subprocess.Popen`` a worker uses
    (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``), safe to call from two threads."""

    def __init__(self, sock: socket.socket, pid: int, pending: bytes = b"") -> None:
        self._sock, self.pid = sock, pid
        self._buf = pending
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout or 0.0)
        return code

    def kill(self) -> None:
        """Ask the zygote to SIGKILL the core (by closing our side: it knows if the pid is
        still its child, where ``os.kill`` could hit a reused pid)."""
        with self._lock, contextlib.suppress(OSError):
            if self.returncode is None:
                self._sock.shutdown(socket.SHUT_WR)

    def _wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.returncode is None:
                # None: block; 0.0: only what has arrived
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                self._sock.settimeout(left)
                try:
                    data = self._sock.recv(4096)
                except (BlockingIOError, TimeoutError):
                    return None
                except OSError:
                    data = b""
                if not data:  # the zygote is gone, and its cores with it (PDEATHSIG)
                    self._finish(-signal.SIGKILL)
                    break
                self._buf += data
                for line in self._take_lines():
                    if "returncode" in line:
                        self._finish(int(line["returncode"]))
            return self.returncode

    def _take_lines(self) -> list[dict[str, Any]]:
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def _finish(self, code: int) -> None:
        self.returncode = code
        self._sock.close()


def spawn_core(args: list[str]) -> subprocess.Popen[bytes] | ForkedCore:
    """The engine core (``python -m pdserve.worker.core.main ARGS``): forked by the zygote
    named in ``PDSERVE_CORE_ZYGOTE`` when there is one that accepts, else a new process."""
    path = env.get(env.CORE_ZYGOTE)
    if path:
        try:
            return request_core(path, args)
        except (OSError, ValueError, ZygoteRefused) as e:
            logger.warning("engine core: not from the zygote at %s (%s): a new process", path, e)
    return subprocess.Popen([sys.executable, "-m", "pdserve.worker.core.main", *args])


def request_bytes(args: list[str]) -> bytes:
    """A request for a core with ``args``, this process's environment and directory."""
    body = json.dumps({"argv": args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    return struct.pack("!I", len(body)) + body


def request_core(path: str, args: list[str]) -> ForkedCore:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(path)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        socket.send_fds(sock, [request_bytes(args)], [0, 1, 2])
        sock.settimeout(ANSWER_TIMEOUT_S)
        buf = b""
        while b"\n" not in buf:
            data = sock.recv(4096)
            if not data:
                raise ZygoteRefused("the zygote closed the connection")
            buf += data
        line, rest = buf.split(b"\n", 1)
        answer = json.loads(line)
        if "refused" in answer:
            raise ZygoteRefused(answer["refused"])
        return ForkedCore(sock, int(answer["pid"]), rest)
    except BaseException:
        sock.close()
        raise


# -- the zygote's side -----------------------------------------------------------------


def refusal(base: dict[str, str], ours: dict[str, str], wanted: dict[str, str]) -> str:
    """Why a core with environment ``wanted`` cannot fork from a zygote that started with
    ``base`` and has ``ours`` after its imports ("" when it can). A key the imports added
    (torch sets ``TORCHINDUCTOR_CACHE_DIR`` to its default) may be missing from ``wanted``:
    a new process's imports would add it alike."""
    keys = sorted(
        k
        for k in ours.keys() | wanted.keys()
        if ours.get(k) != wanted.get(k)
        and k not in RUNTIME_KEYS
        and not k.startswith(RUNTIME_PREFIXES)
        and not (k not in wanted and k not in base)
    )
    return f"environment differs from the zygote's in {', '.join(keys)}" if keys else ""


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10.0)
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)

    def read_to(n: int) -> bytes:
        nonlocal data
        while len(data) < n:
            more = conn.recv(65536)
            if not more:
                raise ValueError("request cut short")
            data += more
        return data

    try:
        size = struct.unpack("!I", read_to(4)[:4])[0]
        if size > MAX_REQUEST:
            raise ValueError("request too large")
        request = json.loads(read_to(4 + size)[4:])
        if len(fds) != 3 or not isinstance(request, dict):
            raise ValueError("a request is a JSON object with three file descriptors")
        return request, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Zygote:
    """The zygote's loop: accept requests, fork cores, report their exits."""

    def __init__(
        self, listener: socket.socket, base_env: dict[str, str], lifeline: int | None = None
    ) -> None:
        self.listener = listener
        self.base_env = base_env  # as the zygote started, before its imports changed it
        self.env = dict(os.environ)  # after them
        self.sel = selectors.DefaultSelector()
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        self.wake_w = wake_w
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "reap")
        if lifeline is not None:  # the starter's pipe: its end closes when it dies
            self.sel.register(lifeline, selectors.EVENT_READ, "starter")
        self.children: dict[int, socket.socket] = {}  # pid -> its worker's connection

    def run(self) -> None:
        while True:
            for key, _ in self.sel.select():
                try:  # one worker's trouble must not end the zygote (and every core)
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "reap":
                        os.read(self.wake_r, 512)
                        self._reap()
                    elif key.data == "starter":
                        if not os.read(key.fd, 512):  # it is gone: so are we, and the cores
                            return
                    else:
                        self._lifeline(key.fileobj, key.data)  # type: ignore[arg-type]
                except Exception:
                    traceback.print_exc()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _read_request(conn)
        except (OSError, ValueError) as e:
            print(f"core zygote: bad request: {e}", file=sys.stderr, flush=True)
            conn.close()
            return
        try:
            wanted = {str(k): str(v) for k, v in request["env"].items()}
            why = refusal(self.base_env, self.env, wanted)
            if why:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
                conn.close()
                return
            pid = self._fork(request, wanted, fds, conn)
        finally:
            for fd in fds:
                os.close(fd)
        self.children[pid] = conn  # reaped (and reported, if it can be) whatever follows
        try:
            conn.setblocking(True)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the worker left before it heard: nobody owns this core
            os.kill(pid, signal.SIGKILL)
            return
        self.sel.register(conn, selectors.EVENT_READ, pid)

    def _fork(
        self, request: dict[str, Any], wanted: dict[str, str], fds: list[int], conn: socket.socket
    ) -> int:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the core: nothing of the zygote's loop stays open in it
            # A session of its own, so a CFS autogroup of its own (kernel.sched_autogroup_
            # enabled): in the zygote's, every core of the cluster shared one group's CPU
            # against each front end's and the router's; a loaded run stalled streams.
            os.setsid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.sel.close()
            for sock in (self.listener, conn, *self.children.values()):
                sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.chdir(request["cwd"])
            # As a new process would have it: the request's, plus what the imports added;
            # it differs from ours only in runtime keys (refusal)
            for key in self.env.keys() | wanted.keys():
                if key in wanted:
                    os.environ[key] = wanted[key]
                elif key in self.base_env:
                    os.environ.pop(key, None)
            if os.environ.get("PYTHONUNBUFFERED"):
                sys.stdout.reconfigure(write_through=True)  # type: ignore[union-attr]
            code = run_core([str(a) for a in request["argv"]])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

    def _lifeline(self, conn: socket.socket, pid: int) -> None:
        """The worker's side of a core's connection is readable: closed (the worker died or
        asked for a kill), so the core is killed; its exit is reported when reaped."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if data:
            return  # a worker sends nothing after its request: ignore
        self.sel.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(conn)
            with contextlib.suppress(OSError):
                code = os.waitstatus_to_exitcode(status)
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            conn.close()


def run_core(argv: list[str]) -> int:
    """What ``python -m pdserve.worker.core.main ARGV`` runs, in a forked child."""
    from pdserve.worker.core import main as core_main

    sys.argv = [core_main.__file__, *argv]
    return core_main.main(argv)


def preload(modules: tuple[str, ...]) -> None:
    """Import ``modules`` with the collector off, then freeze every object so far (Python's
    own advice for a parent that forks without exec), the collector on again whatever
    happened. Measured on the 2-core dev machine: the imports took 3.8-4.1 CPU-s instead
    of 4.7-4.9 (the collector's passes over them found nothing to free), each core's load
    and probe ~0.15 CPU-s less (its passes skip the zygote's ~600,000 objects), and the
    pages those objects sit on stay shared with the cores; ~8 MB of the imports' cyclic
    garbage is kept for good."""
    import importlib

    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        gc.freeze()
        gc.enable()


def serve(path: str, lifeline: int | None = None) -> None:
    """Serve on ``path``; with ``lifeline`` (a pipe's read end), until its writer is gone:
    the process that started the zygote, so that a ``pdserve up`` killed hard leaves no
    zygote behind (its cores die with the zygote)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound and listening under another name, then renamed: the path appears ready. A
    # starter waits for the path (ZygoteProcess); bound at the path itself, a connect that
    # came between bind and listen was refused (seen once under a loaded test run).
    staging = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)
    listener.bind(staging)
    listener.listen(64)
    os.rename(staging, path)
    base_env = dict(os.environ)
    # Bound first, imports after: workers that ask meanwhile wait in the backlog.
    started = time.monotonic()
    preload(PRELOAD)
    print(
        f"core zygote: ready on {path} ({time.monotonic() - started:.1f} s of imports, "
        f"{time.process_time():.1f} CPU-s since its start)",
        file=sys.stderr,
        flush=True,
    )
    try:
        Zygote(listener, base_env, lifeline).run()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


class ZygoteProcess:
    """A zygote this process started (``pdserve up``, the test session): its socket in a
    fresh private directory; ``stop`` ends it and, with it, the cores it forked."""

    def __init__(self, log: IO[Any] | int | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="pdserve-zygote-")  # short: sun_path holds 108
        self.path = str(Path(self.dir, "sock"))
        argv = [sys.executable, "-m", "pdserve.worker.core.zygote", self.path, "--stdin-lifeline"]
        # Its stdin is a pipe only this process writes to: EOF when this process is gone
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=log, stderr=log, start_new_session=True
        )
        deadline = time.monotonic() + 30.0
        while not Path(self.path).exists():  # bound within a Python start-up
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"core zygote did not start (exit {self.proc.returncode})")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(OSError):
            Path(self.path).unlink()
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or argv[1:] not in ([], ["--stdin-lifeline"]):
        print(
            "usage: python -m pdserve.worker.core.zygote SOCKET_PATH [--stdin-lifeline]",
            file=sys.stderr,
        )
        return 2
    serve(argv[0], 0 if argv[1:] else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
