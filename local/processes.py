"""Local processes of one pdserve deployment: workers and routers on one machine.

Used by ``pdserve up``, the benchmarks and the end-to-end tests. Each process
runs ``python -m pdserve <subcommand>`` in its own process group, logging to
its own file; ``stop`` signals every group (SIGTERM, then SIGKILL) so nothing
is left behind. Every process gets the deployment's service secret
(``PDSERVE_SERVICE_SECRET``): the spec's, the caller's environment's, or a new one.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdserve import env
from pdserve.local import drain
from pdserve.local.drain import Listed
from pdserve.local.proc_group import signal_group
from pdserve.protocol.codec import from_dict
from pdserve.protocol.contract import WorkerStats
from pdserve.router.discovery.file import write_workers_file
from pdserve.signed_httpx import SignedAuth
from pdserve.worker.core.zygote import ZygoteProcess

# Stored tensors that are not decoder weights: the token embeddings and the output head
# (GPT-NeoX's is ``embed_out``, GPT-2's embeddings ``wte``/``wpe``).
NOT_DECODER = ("embed", "wte", "wpe", "lm_head")


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def decoder_params(model_dir: str) -> int:
    """The decoder's weight count: every tensor of the model's safetensors files but the
    embeddings and the output head, read from the files' headers (no weights loaded, any
    architecture: MoE experts and MLA's projections count as stored). 0 when none can be
    read."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            header = _safetensors_header(path)
        except (OSError, ValueError):
            return 0
        for name, info in header.items():
            if name != "__metadata__" and not any(n in name for n in NOT_DECODER):
                total += math.prod(info["shape"])
    return total


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8 bytes of little-endian length, then JSON."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 1 << 27:
            raise ValueError(f"{path}: not a safetensors file")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file")
    return header


@dataclass(frozen=True)
class ClusterSpec:
    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    dtype: str = "auto"
    kv_transport: str = "nixl"
    served_model_name: str = ""
    worker_args: tuple[str, ...] = ()  # extra engine args for every worker
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    log_dir: str = ""
    worker_port_base: int = 8100  # prefill workers from here, decode workers from +100
    cpu_threads: int = 0  # torch threads per worker; 0: the machine's cores shared out
    secret: str = ""  # the service secret; "": $PDSERVE_SERVICE_SECRET or a new one
    autoscaled: bool = False  # workers come and go: a lone one never takes every core
    core_zygote: bool = True  # cores fork from one zygote (worker/core/zygote.py)

    def threads_per_worker(self) -> int:
        """Cores over workers (at least 1), one core kept for the router, the workers' HTTP
        loops and detokenization: N workers with all cores each oversubscribe the CPU, and
        an OpenMP thread preempted by the streaming path stalls every op's barrier (vLLM's
        CPU build keeps a core from compute the same way). A lone worker takes every core
        when its model's GEMMs, timed at start-up on this host, run enough faster on all
        cores than on one (``local/thread_probe.py``: measured, never read from the size)."""
        if self.cpu_threads > 0:
            return self.cpu_threads
        cores = host_cores()
        workers = max(1, self.num_prefill + self.num_decode)
        lone = workers == 1 and not self.autoscaled
        if lone and cores > 1 and self.lone_worker_probe().get("all_cores"):
            return cores
        return max(1, (cores - 1) // workers)

    def lone_worker_probe(self) -> dict[str, Any]:
        """The start-up thread probe of this spec's model (cached per process)."""
        from pdserve.local import thread_probe

        return thread_probe.probe(self.model_dir, self.dtype, host_cores())

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


@dataclass
class Proc:
    name: str
    role: str  # "prefill" | "decode" | "router"
    url: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    spawned_at: float = 0.0  # time.monotonic() of the last spawn (the planner learns start-up)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def port_block_free(host: str, base: int, width: int = 3) -> bool:
    for port in range(base, base + width):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def pick_base_port(host: str, start: int, taken: set[int], width: int = 3) -> int:
    """The first ``start + 10k`` whose ``width`` ports are free and not handed out yet."""
    base = start
    while any(p in taken for p in range(base, base + width)) or not port_block_free(
        host, base, width
    ):
        base += 10
        assert base < 65000, "no free ports"
    taken.update(range(base, base + width))
    return base


def pdserve_cmd(subcommand: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", subcommand, *args]


@dataclass
class LocalCluster:
    spec: ClusterSpec
    procs: list[Proc] = field(default_factory=list)
    workers_file: Path | None = None  # set by start_router(dynamic=True)
    _ports: set[int] = field(default_factory=set)
    _started: dict[str, int] = field(default_factory=dict)  # workers ever started, per role
    zygote: ZygoteProcess | None = None  # the cluster's core zygote, once a worker needs it

    def __post_init__(self) -> None:
        # One per deployment: the spec's, the environment's (to pin it), else a new one.
        self.secret = self.spec.secret or env.get(env.SERVICE_SECRET) or secrets.token_hex(32)
        log_dir = self.spec.log_dir or f"/tmp/pdserve-logs-{os.getpid()}"
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def auth(self) -> SignedAuth:
        """Signs calls to the workers' internal API with the service secret (the secret
        itself is never sent). Replies are not checked for the workers' proof, so one
        client serves the router's paths too."""
        return SignedAuth(self.secret, check_proof=False)

    def urls(self, role: str) -> list[str]:
        return [p.url for p in self.procs if p.role == role]

    def _serving(self, port: int) -> list[str]:
        """The flags of every process: the model it serves and the address it binds."""
        return ["--model", self.spec.model_dir, "--host", self.spec.host, "--port", str(port)]

    def _common(self, name: str, port: int) -> list[str]:
        s = self.spec
        out = [
            *self._serving(port),
            *("--worker-id", name, "--kv-transport", s.kv_transport, "--dtype", s.dtype),
        ]
        if s.served_model_name:
            out += ["--served-model-name", s.served_model_name]
        named = any(a == "--cpu-threads" or a.startswith("--cpu-threads=") for a in s.worker_args)
        if not named:  # else the worker arg decides: no probe (a child importing torch) for it
            out += ["--cpu-threads", str(s.threads_per_worker())]
        return out + list(s.worker_args)

    def start_workers(self) -> None:
        for _ in range(self.spec.num_prefill):
            self.add_worker("prefill")
        for _ in range(self.spec.num_decode):
            self.add_worker("decode")

    def add_worker(self, role: str) -> Proc:
        """Start one more worker (names count up: prefill-0, prefill-1, ...); if the router
        reads a workers file, it learns about the worker on its next health round."""
        assert role in ("prefill", "decode"), role
        s, i = self.spec, self._started.get(role, 0)
        self._started[role] = i + 1
        name = f"{role}-{i}"
        base = s.worker_port_base + (0 if role == "prefill" else 100)
        port = pick_base_port(s.host, base, self._ports)
        if role == "prefill":
            argv = pdserve_cmd(
                "prefill-worker",
                *self._common(name, port),
                "--kv-events-port",
                str(port + 1),
                "--side-channel-port",
                str(port + 2),
                *s.prefill_args,
            )
        else:
            argv = pdserve_cmd(
                "decode-worker",
                *self._common(name, port),
                "--side-channel-port",
                str(port + 2),
                *s.decode_args,
            )
        proc = Proc(name, role, f"http://{s.host}:{port}", argv, self.log_dir / f"{name}.log")
        self._spawn(proc)
        self._write_workers_file()
        return proc

    def remove_worker(
        self, proc: Proc, drain_timeout_s: float = 30.0, listed: Listed | None = None
    ) -> bool:
        """Take ``proc`` out of the router's workers file, wait until the router no longer
        routes to it (``listed``: whether the router still lists a URL; see local/drain.py)
        and it owes no request, up to ``drain_timeout_s`` in all, then stop its process
        group. Returns whether it drained in time (it is stopped either way)."""
        assert proc in self.procs and proc.role in ("prefill", "decode"), proc.name
        self.procs.remove(proc)
        try:  # whatever happens, the process must not outlive its place in self.procs
            self._write_workers_file()
            deadline = time.monotonic() + drain_timeout_s

            def alive() -> bool:
                return proc.popen is not None and proc.popen.poll() is None

            unrouted = listed is None or drain.wait_unrouted(proc.url, listed, deadline, alive)
            return unrouted and drain.wait_idle(proc.url, self.auth, deadline, alive)
        finally:
            _stop_procs([proc], grace_s=10.0)

    def _router_port(self) -> int:
        """Any port for a router: the top ten of the spec's worker block (base + 190 ..
        199; workers take base .. base + 189 in steps of 10), so a caller that reserved the
        block machine-wide (the tests' flock) reserved its routers' ports too. Two clusters
        that both searched from 8000 could pick one port, and the router that lost the bind
        looked healthy through the other cluster's router (seen in CI)."""
        s = self.spec
        top = s.worker_port_base + 190
        for port in range(top, top + 10):
            if port not in self._ports and port_block_free(s.host, port, 1):
                self._ports.add(port)
                return port
        return pick_base_port(s.host, 8000, self._ports, 1)

    def _write_workers_file(self) -> None:
        if self.workers_file is not None:
            write_workers_file(self.workers_file, self.urls("prefill"), self.urls("decode"))

    def start_router(
        self,
        port: int = 8000,
        name: str = "router",
        args: Sequence[str] = (),
        dynamic: bool = False,
    ) -> Proc:
        s = self.spec
        if port == 0:
            port = self._router_port()
        elif not port_block_free(s.host, port, 1):
            port = pick_base_port(s.host, port + 1, self._ports, 1)
        argv = pdserve_cmd("router", *self._serving(port), "--served-model-name", s.model_name)
        if dynamic:  # the worker list changes while the router runs: a file it re-reads
            self.workers_file = self.log_dir / f"{name}-workers.json"
            self._write_workers_file()
            argv += ["--workers-file", str(self.workers_file), *args]
        else:
            if self.urls("prefill"):
                argv += ["--prefill", *self.urls("prefill")]
            argv += ["--decode", *self.urls("decode"), *args]
        proc = Proc(name, "router", f"http://{s.host}:{port}", argv, self.log_dir / f"{name}.log")
        self._spawn(proc)
        return proc

    def _zygote_env(self) -> dict[str, str]:
        """Where the workers' cores fork from: a zygote the caller runs already (its socket
        in ``PDSERVE_CORE_ZYGOTE``: the test session's), else this cluster's, started for
        its first worker and again if it died; "" (a process per core) without one."""
        if not self.spec.core_zygote:
            return {env.CORE_ZYGOTE: ""}
        if env.get(env.CORE_ZYGOTE):
            return {}
        if self.zygote is None or self.zygote.proc.poll() is not None:
            with open(self.log_dir / "core-zygote.log", "ab") as log:
                self.zygote = ZygoteProcess(log=log)
        return {env.CORE_ZYGOTE: self.zygote.path}

    def _spawn(self, proc: Proc, mode: str = "wb") -> None:
        environ = dict(os.environ, PYTHONUNBUFFERED="1", **{env.SERVICE_SECRET: self.secret})
        environ[env.PARENT_PID] = str(os.getpid())  # it ends when this process is gone
        if proc.role != "router":
            environ.update(self._zygote_env())
        with open(proc.log_path, mode) as log:
            proc.popen = subprocess.Popen(
                proc.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=environ,
                start_new_session=True,  # own process group: stop() kills it whole
            )
        proc.spawned_at = time.monotonic()
        if proc not in self.procs:
            self.procs.append(proc)

    def restart(self, proc: Proc) -> None:
        """Start ``proc`` again in place (same ports and arguments; its log is appended to)
        after it exited; whatever its group left behind is killed first."""
        assert proc in self.procs and proc.popen is not None and proc.popen.poll() is not None
        _signal_group(proc, signal.SIGKILL)
        self._spawn(proc, mode="ab")

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen is not None and p.popen.poll() is not None]

    def wait_healthy(
        self, timeout: float = 300.0, on_ready: Callable[[Proc, float], None] | None = None
    ) -> None:
        """Block until every process answers ``GET /health`` with 200; raise if one dies."""
        start, pending = time.monotonic(), [p for p in self.procs]
        # /health is open; /stats (which process answers) takes a signed call
        with httpx.Client(timeout=2.0, auth=self.auth) as client:
            while pending:
                for proc in list(pending):
                    if proc.popen is not None and proc.popen.poll() is not None:
                        raise RuntimeError(
                            f"{proc.name} exited with code {proc.popen.returncode}; "
                            f"log {proc.log_path}:\n{proc.log_tail()}"
                        )
                    try:
                        ok = client.get(proc.url + "/health").status_code == 200
                        if ok and proc.role != "router" and proc.popen is not None:
                            # The port is ours only if the process answering is ours: another
                            # one may have bound it between our port check and our bind.
                            stats = client.get(proc.url + "/stats").json()
                            pid = from_dict(stats, WorkerStats).pid
                            if pid != proc.popen.pid:
                                raise RuntimeError(f"{proc.url} is served by pid {pid}, not ours")
                    except (httpx.HTTPError, ValueError):  # CodecError is a ValueError
                        ok = False
                    if ok:
                        pending.remove(proc)
                        if on_ready is not None:
                            on_ready(proc, time.monotonic() - start)
                if pending and time.monotonic() - start > timeout:
                    names = ", ".join(p.name for p in pending)
                    raise TimeoutError(f"not healthy after {timeout:.0f}s: {names}")
                if pending:
                    time.sleep(0.1)

    def wait_routed(self, router: Proc, timeout: float = 120.0, api_key: str = "") -> None:
        """Block until ``router`` lists every worker process as healthy (``GET /workers``).

        A router that answers ``/health`` may not have polled every worker yet; until
        it has, it routes around the ones it has not seen (a prefill worker, say). The
        deadline is generous because a 2-core host that is starting a whole cluster (and,
        under CI, another test's cluster beside it) can starve one router's health loop for
        tens of seconds; a router that never routes still fails, with its listing and log.
        """
        want = {p.url for p in self.procs if p.role in ("prefill", "decode")}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout
        listed: object = None
        with httpx.Client(timeout=5.0, headers=headers) as client:
            while True:
                try:
                    rows = client.get(router.url + "/workers").json()["workers"]
                    listed, seen = rows, {w["url"] for w in rows if w.get("healthy")}
                except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
                    listed, seen = repr(exc), set()
                if want <= seen:
                    return
                if time.monotonic() > deadline:
                    missing = ", ".join(sorted(want - seen))
                    raise TimeoutError(
                        f"{router.name} does not route to {missing} after {timeout:.0f}s; "
                        f"it lists {listed}\nlog {router.log_path}:\n{router.log_tail()}"
                    )
                time.sleep(0.1)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, wait, SIGKILL stragglers. Safe to call twice."""
        _stop_procs(self.procs, grace_s)
        if self.zygote is not None:  # after the workers: their cores die with it
            self.zygote.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_procs(procs: list[Proc], grace_s: float) -> None:
    live = [p for p in procs if p.popen is not None and p.popen.poll() is None]
    for p in reversed(live):  # routers first, then workers
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        assert p.popen is not None
        try:
            p.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.popen.wait(5)
    for p in procs:  # children the leader left behind in its group
        _signal_group(p, signal.SIGKILL)


def _signal_group(proc: Proc, sig: int) -> None:
    if proc.popen is not None:
        signal_group(proc.popen, sig)
