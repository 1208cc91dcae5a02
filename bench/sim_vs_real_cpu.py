"""CPU accounting of the real side of sim_vs_real.py, from /proc (Linux).

A thread samples, every ``period_s``, the cumulative CPU time (user + system) of every
process under ``pdserve up`` (named by role: ``up``, ``router``, ``prefill-0``, ...), of
this process (the load client), and the whole machine's busy time from /proc/stat. What
it gives the simulator's host model (planner/sim/host.py): the CPU seconds the router, the
client and ``pdserve up`` itself spent per request, what a worker spent starting, and
how much of the cores other people's jobs took meanwhile.

A worker's engine core is counted as the worker's: a core that is the worker's child by
its command line (``pdserve.worker.core.main``), and one forked by ``pdserve up``'s core
zygote (whose command line it keeps, under the zygote) by the ``core_pid`` its worker's
``/stats`` names (a signed call: ``secret``, the service secret ``pdserve up`` was given).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from lib.procfs import TICK, cpu_seconds

from pdserve.signed_httpx import SignedAuth


def _engine_cpu(pid: int, proc: str = "/proc") -> float:
    """CPU seconds of the worker's engine thread (it names itself ``pdserve-engine``; with
    one torch thread the model runs on it), so the rest is HTTP, streaming and KV transfer."""
    total = 0.0
    for task in os.scandir(Path(proc, str(pid), "task")):
        try:
            if Path(task.path, "comm").read_text().strip() == "pdserve-engine":
                raw = Path(task.path, "stat").read_text()
                fields = raw[raw.rindex(")") + 2 :].split()
                total += (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, ValueError):
            continue
    return total


Autogroup = tuple[int, int]  # (autogroup id, its nice); id 0: the root group


def autogroup_of(pid: int, proc: str = "/proc") -> Autogroup:
    """The autogroup ``pid`` is scheduled in (``/proc/PID/autogroup``, e.g.
    ``/autogroup-3371 nice 19``). With ``kernel.sched_autogroup_enabled`` every session
    is one CFS group at the top level, weighted by this nice, not by its processes' nice
    (planner/sim/host.py). A process in the root group (kernel threads, init's session; the
    file is empty) is ``(0, its own nice)``: it competes there by itself."""
    text = Path(proc, str(pid), "autogroup").read_text().split()
    if len(text) >= 3 and text[0].startswith("/autogroup-") and text[1] == "nice":
        return int(text[0].removeprefix("/autogroup-")), int(text[2])
    return 0, nice_of(pid, proc)


def autogroup_enabled(proc: str = "/proc") -> bool:
    try:
        return Path(proc, "sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def _proc_table(proc: str = "/proc") -> dict[int, tuple[int, float, int, Autogroup]]:
    """pid -> (parent pid, CPU seconds so far, nice, autogroup) of every process."""
    out = {}
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            try:
                raw = Path(entry.path, "stat").read_text()
                f = raw[raw.rindex(")") + 2 :].split()
                cpu = (int(f[11]) + int(f[12])) / TICK
                group = autogroup_of(int(entry.name), proc)
                out[int(entry.name)] = (int(f[1]), cpu, int(f[16]), group)
            except (OSError, ValueError, IndexError):
                continue
    return out


def _role(pid: int, proc: str = "/proc") -> str | None:
    try:
        argv = Path(proc, str(pid), "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv]
    if "--worker-id" in args:
        return args[args.index("--worker-id") + 1]
    if "router" in args:
        return "router"
    if "up" in args and "pdserve" in args:
        return "up"
    return None  # nice, a compiler child, ...: not ours to name


def _runs(pid: int, module: bytes, proc: str = "/proc") -> bool:
    """Whether ``pid``'s command line names ``module``."""
    try:
        return module in Path(proc, str(pid), "cmdline").read_bytes()
    except OSError:
        return False


def _is_core(pid: int, proc: str = "/proc") -> bool:
    """A worker's engine core (its child process): counted as the worker's."""
    return _runs(pid, b"pdserve.worker.core.main", proc)


def _is_zygote(pid: int, proc: str = "/proc") -> bool:
    """``pdserve up``'s core zygote, or a core forked by it (it keeps the zygote's argv)."""
    return _runs(pid, b"pdserve.worker.core.zygote", proc)


def _port(pid: int, proc: str = "/proc") -> int | None:
    """A worker's HTTP port, from its ``--port`` argument."""
    try:
        args = Path(proc, str(pid), "cmdline").read_bytes().split(b"\0")
        return int(args[args.index(b"--port") + 1])
    except (OSError, ValueError, IndexError):
        return None


def machine_busy_s(proc: str = "/proc") -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    vals = [int(v) for v in Path(proc, "stat").read_text().split("\n")[0].split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / TICK


def nice_of(pid: int, proc: str = "/proc") -> int:
    raw = Path(proc, str(pid), "stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[16])


@dataclass
class Sample:
    t: float  # time.monotonic()
    machine_s: float
    client_s: float
    procs: dict[str, float]  # role name -> cumulative CPU seconds
    # the other jobs: pid -> (CPU seconds since the previous sample, nice, autogroup id,
    # autogroup nice), busy ones only; the host model shares the cores with them by CFS
    # weight (planner/sim/host.py)
    others: dict[int, tuple[float, int, int, int]] = field(default_factory=dict)
    groups: dict[str, int] = field(default_factory=dict)  # our role -> its autogroup's nice


@dataclass
class CpuSampler:
    root: int  # pid of `pdserve up`
    period_s: float = 0.5
    proc: str = "/proc"  # a synthetic tree in tests
    # lower our processes' autogroups to their nice (``nice -n 19`` means nothing to the
    # other sessions otherwise: planner/sim/host.py); False leaves them as the kernel made them
    polite: bool = True
    secret: str = ""  # the service secret: a forked core's worker is asked for its core_pid
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _last: dict[int, float] = field(default_factory=dict)  # other jobs' CPU at the last sample
    _ports: dict[str, int] = field(default_factory=dict)  # worker role -> its HTTP port
    _cores: dict[int, str] = field(default_factory=dict)  # forked core pid -> worker role
    # forked cores not named yet: pid -> [(sample index, CPU s, engine thread CPU s)]
    _unnamed: dict[int, list[tuple[int, float, float]]] = field(default_factory=dict)

    def start(self) -> CpuSampler:
        threading.Thread(target=self._loop, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self.sample())

    def sample(self) -> Sample:
        table = _proc_table(self.proc)
        procs, groups, ours = self._ours(table)
        client = sum(os.times()[:2])
        others = {}
        for pid, (_, cpu, nice, (group, group_nice)) in table.items():
            if pid not in ours:
                used = cpu - self._last.get(pid, cpu)  # a new process: counted from now
                self._last[pid] = cpu
                if used > 0:
                    others[pid] = (used, nice, group, group_nice)
        busy = machine_busy_s(self.proc)
        return Sample(time.monotonic(), busy, client, procs, others, groups)

    def _ours(self, table: dict) -> tuple[dict[str, float], dict[str, int], set[int]]:
        """CPU per role and each role's autogroup nice, over the tree under `pdserve up`."""
        children: dict[int, list[int]] = {}
        for pid, row in table.items():
            children.setdefault(row[0], []).append(pid)
        todo: list[tuple[int, str | None]] = [(self.root, None)]
        procs: dict[str, float] = {}
        groups: dict[str, int] = {}
        ours = {os.getpid()}  # the client and the process tree under `pdserve up`
        forked = []  # cores under the zygote: named once every worker was seen
        while todo:
            pid, parent_role = todo.pop()
            ours.add(pid)
            role = _role(pid, self.proc) or (parent_role if _is_core(pid, self.proc) else None)
            todo += [(child, role) for child in children.get(pid, [])]
            if role is None and _is_zygote(table.get(pid, (0,))[0], self.proc):
                forked.append(pid)
            elif role is not None and role not in ("up", "router") and role not in self._ports:
                port = _port(pid, self.proc)
                if port is not None:
                    self._ports[role] = port
            if role is not None:
                self._count(pid, role, table, procs, groups)
        for pid in forked:
            role = self._core_role(pid)
            if role is not None:
                self._count(pid, role, table, procs, groups)
                self._backfill(pid, role)
            elif pid in table:  # its worker does not answer yet (starting): kept for later
                try:
                    seen = (
                        len(self.samples),
                        cpu_seconds(pid, proc=self.proc),
                        _engine_cpu(pid, self.proc),
                    )
                except (OSError, ValueError):
                    continue
                self._unnamed.setdefault(pid, []).append(seen)
        return procs, groups, ours

    def _backfill(self, pid: int, role: str) -> None:
        """Add a core's CPU from the samples taken before its worker named it (a worker
        answers ``/stats`` once its core is ready: the start-up is the core's work)."""
        for i, cpu, engine in self._unnamed.pop(pid, []):
            if i < len(self.samples):
                procs = self.samples[i].procs
                procs[role] = procs.get(role, 0.0) + cpu
                procs[role + "/engine"] = procs.get(role + "/engine", 0.0) + engine

    def _core_role(self, pid: int) -> str | None:
        """The worker a zygote-forked core serves: asked once of the workers whose core is
        not known yet (``/stats``' ``core_pid``)."""
        if pid not in self._cores and self.secret:
            named = set(self._cores.values())
            for role, port in self._ports.items():
                if role in named:
                    continue
                try:
                    reply = httpx.get(
                        f"http://127.0.0.1:{port}/stats", timeout=0.5, auth=SignedAuth(self.secret)
                    )
                    core = int(reply.json().get("core_pid", 0))
                except (httpx.HTTPError, ValueError, AttributeError):
                    continue  # not ready yet: asked again at the next sample
                if core:
                    self._cores[core] = role
        return self._cores.get(pid)

    def _count(
        self, pid: int, role: str, table: dict, procs: dict[str, float], groups: dict[str, int]
    ) -> None:
        """Add ``pid``'s CPU (and its engine thread's) to ``role``'s."""
        if pid not in table:
            return
        _, _, nice, (group, group_nice) = table[pid]
        if self.polite and group and group_nice < nice:
            group_nice = _lower_autogroup(pid, nice, group_nice, self.proc)
        groups.setdefault(role, group_nice)
        try:
            procs[role] = procs.get(role, 0.0) + cpu_seconds(pid, proc=self.proc)
            if role not in ("up", "router"):
                key = role + "/engine"
                procs[key] = procs.get(key, 0.0) + _engine_cpu(pid, self.proc)
        except (OSError, ValueError):
            return


def _lower_autogroup(pid: int, nice: int, now: int, proc: str) -> int:
    """Set ``pid``'s autogroup to its own nice (root may; else it stays as it was)."""
    try:
        Path(proc, str(pid), "autogroup").write_text(str(nice))
        return nice
    except OSError:
        return now


def cpu_between(samples: list[Sample], t0: float, t1: float) -> dict[str, float]:
    """CPU seconds per role over [t0, t1] (a process that exited keeps its last value),
    plus ``client`` and ``machine`` (every process on the host)."""
    inside = [s for s in samples if t0 <= s.t <= t1]
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    out: dict[str, float] = {}
    seen: dict[str, float] = {}
    for s in inside:  # a role's last value, then minus its first
        seen.update(s.procs)
    for role, end in seen.items():
        out[role] = end - first.procs.get(role, 0.0)
    out["client"] = last.client_s - first.client_s
    out["machine"] = last.machine_s - first.machine_s
    out["span_s"] = last.t - first.t
    return out
