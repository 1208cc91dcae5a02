"""The host model under autogroup scheduling (planner/sim/host.py, sim_vs_real_cpu.py).

With ``kernel.sched_autogroup_enabled`` every session is one CFS group at the top level,
weighted by its autogroup's nice; a process's own nice only ranks it inside its session.
A synthetic /proc tree (no real processes) checks what the sampler reads and writes;
pure functions check how the other jobs and our workers then share the cores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sim_vs_real_cpu import TICK, CpuSampler, _proc_table, autogroup_enabled, autogroup_of
from sim_vs_real_host import _jobs, _our_groups

from pdserve.planner.sim.host import Host, autogroup_entities, nice_weight

pytestmark = pytest.mark.unit

W19, W0 = nice_weight(19), nice_weight(0)


def _proc(root: Path, pid: int, ppid: int, cpu_s: float, nice: int, group: str, argv: str) -> None:
    d = root / str(pid)
    (d / "task" / str(pid)).mkdir(parents=True)
    ticks = round(cpu_s * TICK)
    rest = f"S {ppid} 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 {nice} 1 0 0"
    (d / "stat").write_text(f"{pid} (x y) {rest}\n")  # a space in comm, as python's may have
    (d / "autogroup").write_text(group)
    (d / "cmdline").write_bytes(argv.replace(" ", "\0").encode() + b"\0")
    (d / "task" / str(pid) / "comm").write_text("pdserve-engine\n" if "worker" in argv else "x\n")
    (d / "task" / str(pid) / "stat").write_text(f"{pid} (x) {rest}\n")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (tmp_path / "stat").write_text("cpu  100 0 50 1000 0 0 0 0 0 0\n")
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "sys/kernel/sched_autogroup_enabled").write_text("1\n")
    _proc(tmp_path, 100, 1, 1.0, 19, "/autogroup-100 nice 0\n", "python -m pdserve up")
    _proc(tmp_path, 101, 100, 2.0, 19, "/autogroup-101 nice 0\n", "python --worker-id decode-0")
    _proc(tmp_path, 200, 1, 5.0, 19, "/autogroup-200 nice 19\n", "python hog.py")
    _proc(tmp_path, 201, 1, 3.0, 0, "/autogroup-200 nice 19\n", "python other.py")
    _proc(tmp_path, 2, 0, 4.0, -5, "", "kthread")  # the root group: an empty file
    return tmp_path


def test_the_sampler_reads_autogroups_and_lowers_ours_to_their_nice(proc: Path) -> None:
    assert autogroup_enabled(str(proc)) and not autogroup_enabled(str(proc / "nowhere"))
    assert autogroup_of(200, str(proc)) == (200, 19)
    assert autogroup_of(2, str(proc)) == (0, -5)  # root group: by its own nice
    table = _proc_table(str(proc))
    assert table[201] == (1, pytest.approx(3.0), 0, (200, 19))
    sampler = CpuSampler(100, proc=str(proc))
    first = sampler.sample()
    # `pdserve up` and the worker run at nice 19 in fresh sessions (autogroup nice 0):
    # the sampler lowers their autogroups to 19, as `nice -n 19` means to other sessions
    assert first.groups == {"up": 19, "decode-0": 19}
    assert (proc / "101" / "autogroup").read_text() == "19"
    assert first.procs["decode-0"] == pytest.approx(2.0)
    assert first.procs["decode-0/engine"] == pytest.approx(2.0)
    _proc_cpu_add(proc, 200, 5.5)
    second = sampler.sample()
    assert set(second.others) == {200}  # only what ran since the first sample
    assert second.others[200] == (pytest.approx(0.5), 19, 200, 19)
    impolite = CpuSampler(100, proc=str(proc), polite=False)
    (proc / "101" / "autogroup").write_text("/autogroup-101 nice 0\n")
    assert impolite.sample().groups["decode-0"] == 0


def _proc_cpu_add(proc: Path, pid: int, cpu_s: float) -> None:
    stat = proc / str(pid) / "stat"
    f = stat.read_text().split(" ")
    f[14] = str(round(cpu_s * TICK))  # utime: "pid (x y) S ..." puts it 15th
    stat.write_text(" ".join(f))


def test_a_session_is_one_entity_weighted_by_its_autogroup() -> None:
    procs = [
        (1, 0.9, 19, 50, 19, True),  # two hogs in one nice-19 session: wants 2 cores
        (2, 0.6, 19, 50, 19, True),
        (3, 0.3, 0, 60, 0, False),  # a light job in a nice-0 session: what it took
        (4, 0.2, -5, 0, 0, False),  # a kernel thread, root group: by itself at nice -5
    ]
    got = sorted(autogroup_entities(procs, our_nice=19), key=lambda g: g[2])
    assert got == [
        (1.0, 2.0, W19),
        (1.0, pytest.approx(0.3), W0),
        (1.0, pytest.approx(0.2), nice_weight(-5)),
    ]


def _host(jobs: tuple, ours: float | None) -> Host:
    return Host(
        2.0,
        np.array([0.0]),
        np.array([1.0]),
        0.0,
        0.0,
        0.0,
        background_groups=(jobs,),
        nice=19,
        our_weights=(ours,) if ours else (),
    )


def test_per_process_nice_does_not_rank_sessions() -> None:
    engine = [1.0]  # one always-runnable engine of ours, in its own session
    # three nice-19 hogs in ONE other session at autogroup nice 19, our session at 19:
    # two sessions, a core each, where per-process CFS would give our engine half a core
    hogs = ((1.0, 3.0, W19),)
    assert _host(hogs, W19).cpu(0.0, engine, 0, 0.0) == pytest.approx(1.0)
    assert _host(((3.0, 1.0, W19),), None).cpu(0.0, engine, 0, 0.0) == pytest.approx(0.5)
    # the same hogs' session left at autogroup nice 0 takes nearly both cores from ours
    # at 19, whatever the hogs' own nice
    assert _host(((1.0, 3.0, W0),), W19).cpu(0.0, engine, 0, 0.0) == pytest.approx(
        2 * W19 / (W0 + W19), rel=1e-3
    )
    # and if ours were left at autogroup nice 0 too: the two sessions halve the cores
    assert _host(((1.0, 3.0, W0),), W0).cpu(0.0, engine, 0, 0.0) == pytest.approx(1.0)


def test_a_recording_with_autogroups_is_read_per_session() -> None:
    # 0.5 s samples for 2 s: pids 7 and 8 are hogs of one session (autogroup 70, nice 19)
    # squeezed to 0.4 of a core each; our worker's autogroup went from 0 to 19 at 1 s
    others = [[0.0, []]]
    groups = []
    for k in range(1, 5):
        others.append([k * 0.5, [[7, 0.2, 19, 70, 19], [8, 0.2, 19, 70, 19]]])
    for k in range(5):
        groups.append([k * 0.5, {"decode-0": 0 if k < 2 else 19, "router": 0}])
    dump = {"others": others, "groups": groups, "autogroup": True, "nice": {"up": 19}}
    kept = np.arange(4) * 0.5
    ours = _our_groups(dump, kept)
    assert ours == (0, 0, 19, 19)  # the workers' autogroup, not the router's
    jobs = _jobs(dump, 2.0, 19, ours=ours)
    assert [w for w in jobs] == [((1.0, 2.0, W19),)] * 4  # one session wanting 2 cores
    # without autogroup data (an older recording, or the kernel's switch off) it is ()
    assert _our_groups({**dump, "autogroup": False}, kept) == ()
    old = {"others": [[t, [p[:3] for p in procs]] for t, procs in others], "autogroup": True}
    assert _our_groups({**old, "groups": groups}, kept) == ()


class _StatsServer:
    """A worker's ``/stats`` on loopback (a thread): 503 until ``ready``, then its core's pid,
    with the proof of the service secret the sampler checks."""

    def __init__(self, secret: str, core_pid: int) -> None:
        import http.server
        import threading

        from pdserve import keys, signing

        key = keys.KeyRing(keys.HTTP, secret).signing
        outer = self
        self.ready = False

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if not outer.ready:
                    self.send_response(503)
                    self.end_headers()
                    return
                body = f'{{"core_pid": {core_pid}}}'.encode()
                self.send_response(200)
                self.send_header(
                    signing.PROOF_HEADER, signing.proof(key, self.headers[signing.HEADER])
                )
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_a_core_forked_by_the_zygote_counts_as_its_workers_from_its_fork(tmp_path: Path) -> None:
    """``pdserve up``'s cores fork from its core zygote and keep the zygote's command line:
    the sampler names each by its worker's ``/stats`` (signed), and once named adds the CPU
    it used before (while starting, its worker does not answer yet) to the earlier samples."""
    (tmp_path / "stat").write_text("cpu  100 0 50 1000 0 0 0 0 0 0\n")
    server = _StatsServer("s3cret", core_pid=103)
    try:
        zygote = "python -m pdserve.worker.core.zygote /tmp/sock --stdin-lifeline"
        group = "/autogroup-100 nice 0\n"
        _proc(tmp_path, 100, 1, 1.0, 0, group, "python -m pdserve up")
        front = f"python -m pdserve decode-worker --worker-id decode-0 --port {server.port}"
        _proc(tmp_path, 101, 100, 0.5, 0, group, front)
        _proc(tmp_path, 102, 100, 6.0, 0, group, zygote)  # its imports: nobody's start-up
        _proc(tmp_path, 103, 102, 1.0, 0, group, zygote)  # decode-0's core, starting
        sampler = CpuSampler(100, proc=str(tmp_path), polite=False, secret="s3cret")
        sampler.samples.append(sampler.sample())
        assert sampler.samples[0].procs["decode-0"] == pytest.approx(0.5)  # not named yet
        server.ready = True
        _proc_cpu_add(tmp_path, 103, 2.5)
        second = sampler.sample()
        assert second.procs["decode-0"] == pytest.approx(0.5 + 2.5)
        # the engine threads (each synthetic process's one thread is named so): the front's
        # and the core's, whose thread's stat still says 1.0
        assert second.procs["decode-0/engine"] == pytest.approx(0.5 + 1.0)
        assert sampler.samples[0].procs["decode-0"] == pytest.approx(0.5 + 1.0)  # backfilled
        assert sampler.samples[0].procs["decode-0/engine"] == pytest.approx(0.5 + 1.0)
        assert "102" not in str(second.procs) and sampler._cores == {103: "decode-0"}
        # without the secret a forked core is nobody's (and never asked for)
        assert CpuSampler(100, proc=str(tmp_path)).sample().procs["decode-0"] == 0.5
    finally:
        server.httpd.shutdown()
