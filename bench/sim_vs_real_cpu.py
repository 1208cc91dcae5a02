"""CPU accounting of the real side of sim_vs_real.py, from /proc (Linux).

A thread samples, every ``period_s``, the cumulative CPU time (user + system) of every
process under ``pdserve up`` (named by role: ``up``, ``router``, ``prefill-0``, ...), of
this process (the load client), and the whole machine's busy time from /proc/stat. What
it gives the simulator's host model (sim_host.py): the CPU seconds the router, the
client and ``pdserve up`` itself spent per request, what a worker spent starting, and
how much of the cores other people's jobs took meanwhile.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (fields 14 and 15 of /proc/PID/stat)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _engine_cpu(pid: int) -> float:
    """CPU seconds of the worker's engine thread (it names itself ``pdserve-engine``; with
    one torch thread the model runs on it), so the rest is HTTP, streaming and KV transfer."""
    total = 0.0
    for task in os.scandir(f"/proc/{pid}/task"):
        try:
            if Path(task.path, "comm").read_text().strip() == "pdserve-engine":
                raw = Path(task.path, "stat").read_text()
                fields = raw[raw.rindex(")") + 2 :].split()
                total += (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, ValueError):
            continue
    return total


def _proc_table() -> dict[int, tuple[int, float, int]]:
    """pid -> (parent pid, CPU seconds so far, nice) of every process on the machine."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                raw = Path(entry.path, "stat").read_text()
                f = raw[raw.rindex(")") + 2 :].split()
                out[int(entry.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / TICK, int(f[16]))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _role(pid: int) -> str | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
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


def _is_core(pid: int) -> bool:
    """A worker's engine core (its child process): counted as the worker's."""
    try:
        return b"pdserve.worker.core_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (all but idle and iowait)."""
    vals = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / TICK


def nice_of(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rindex(")") + 2 :].split()[16])


@dataclass
class Sample:
    t: float  # time.monotonic()
    machine_s: float
    client_s: float
    procs: dict[str, float]  # role name -> cumulative CPU seconds
    # the other jobs: pid -> (CPU seconds since the previous sample, nice), busy ones only;
    # the host model shares the cores with them by CFS weight (sim_host.py)
    others: dict[int, tuple[float, int]] = field(default_factory=dict)


@dataclass
class CpuSampler:
    root: int  # pid of `pdserve up`
    period_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _last: dict[int, float] = field(default_factory=dict)  # other jobs' CPU at the last sample

    def start(self) -> CpuSampler:
        threading.Thread(target=self._loop, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self.sample())

    def sample(self) -> Sample:
        children: dict[int, list[int]] = {}
        table = _proc_table()
        for pid, (parent, _, _) in table.items():
            children.setdefault(parent, []).append(pid)
        todo: list[tuple[int, str | None]] = [(self.root, None)]
        procs: dict[str, float] = {}
        ours = {os.getpid()}  # the client and the process tree under `pdserve up`
        while todo:  # the process tree under `pdserve up`
            pid, parent_role = todo.pop()
            ours.add(pid)
            role = _role(pid) or (parent_role if _is_core(pid) else None)
            todo += [(child, role) for child in children.get(pid, [])]
            if role is not None:
                try:
                    procs[role] = procs.get(role, 0.0) + _proc_cpu(pid)
                    if role not in ("up", "router"):
                        key = role + "/engine"
                        procs[key] = procs.get(key, 0.0) + _engine_cpu(pid)
                except (OSError, ValueError):
                    continue
        client = sum(os.times()[:2])
        others = {}
        for pid, (_, cpu, nice) in table.items():
            if pid not in ours:
                used = cpu - self._last.get(pid, cpu)  # a new process: counted from now
                self._last[pid] = cpu
                if used > 0:
                    others[pid] = (used, nice)
        return Sample(time.monotonic(), machine_busy_s(), client, procs, others)


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
