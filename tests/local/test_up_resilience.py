"""Worker death under ``pdserve up`` with the real workers on loopback, by ``kill -9``.

- a stream (and a non-streamed request) whose decode worker is killed mid-way moves to
  the other decode worker; the client's text equals an uninterrupted run's, greedy and
  seeded;
- a prefill worker killed under load costs no request (local prefill takes over);
- ``up`` keeps running, restarts the dead worker in place, and it serves again;
- a stream whose decode worker hangs (SIGSTOP: the whole worker, or only its engine
  core, whose silence the worker's /health reports) moves on after the router's stall
  timeout, with the same text; the worker serves again once it resumes;
- a core that stays hung is killed by its worker, and ``up`` restarts the worker;
- every KV pool is free at the end.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.local.proc_group import end_group, poll_until, signal_group
from pdserve.testing.loopback import (
    all_kv_free,
    secret_auth,
    sse_chunks,
)
from pdserve.testing.up import Up, start_up, suite_flags

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

LONG = "Tell me a story about a fox and a crow. " * 8  # remote prefill (threshold 32)
MAX_TOKENS = 300


# The module is among the suite's slowest (~2 min alone): one `pdserve up` of 1 prefill + 3
# decode workers (~25 s to start) serves every test, and each kill is followed by a real
# restart of the worker (process start, model load) that the next test waits for only as far
# as it needs (``_all_back(up, decode=2)`` where two decode workers suffice); the hung-core
# test waits out --core-kill-timeout (10 s: the default, four stall timeouts, was 16 s here),
# which is what it proves. The two SIGSTOP tests resume their worker once its stream has
# migrated (the router's 3 s stall cut and a first token elsewhere), within it; one stopped
# longer (a loaded machine) is killed and restarted, and the test waits for the restart.
@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-resilience")
    flags = ("--prefill", "1", "--decode", "3", "--picker", "round-robin")
    # hung workers are found in seconds here (defaults: 30 s and 10 s)
    stalls = (
        "--worker-arg=--core-stall-timeout=4",
        "--worker-arg=--core-kill-timeout=10",
        "--router-arg=--stall-timeout=3",
    )
    flags += ("--disagg-threshold", "32", *stalls)
    it = start_up(tiny_model_dir, *suite_flags(logs), *flags, timeout=300)
    yield it
    assert end_group(it.proc, grace_s=60) == 0, "".join(it.lines[-30:])


def _body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": "tiny-seed0",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        **kw,
    }


def _stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/stats", timeout=5, auth=secret_auth()).json())


def _stats_or_none(url: str) -> dict[str, Any] | None:
    try:  # a worker restarting after an earlier kill does not answer yet
        return _stats(url)
    except httpx.HTTPError:
        return None


def _kill_busy(urls: list[str], timeout: float = 30.0) -> str:
    """``kill -9`` the worker among ``urls`` that is running a request; returns its URL."""

    def busy() -> str | None:
        for url in urls:
            s = _stats_or_none(url)
            # held: the prefill worker keeps the KV under a lease for a decode worker
            if s is not None and (s["running"] or s["waiting"] or s.get("held")):
                os.kill(int(s["pid"]), signal.SIGKILL)
                return url
        return None

    return poll_until(busy, timeout, 0.005, what="a busy worker")


def _all_back(up: Up, timeout: float = 120.0, decode: int = 0) -> None:
    """Every worker (or: the prefill workers and ``decode`` decode workers) is healthy in
    the router's view again (restarted by up)."""
    listed: list[dict[str, Any]] = []

    def back() -> bool:
        listed[:] = httpx.get(up.url + "/workers", timeout=5).json()["workers"]
        healthy = {w["url"] for w in listed if w["healthy"]}
        ok = set(up.urls("prefill")) <= healthy and (
            len(healthy & set(up.urls("decode"))) >= (decode or len(up.urls("decode")))
        )
        assert ok or up.proc.poll() is None, "pdserve up exited:\n" + "".join(up.lines[-30:])
        return ok

    poll_until(back, timeout, what=lambda: f"every worker back (listed: {listed})")


def _stream_text(up: Up, body: dict[str, Any], kill_after: int | None) -> tuple[str, int]:
    """The streamed text and completion tokens; kills the serving decode worker after
    ``kill_after`` chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], 0
    for n, chunk in enumerate(sse_chunks(up.url + "/v1/completions", body), 1):
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        text += [c["text"] for c in chunk.get("choices", [])]
        if n == kill_after:
            _kill_busy(up.urls("decode"))
    return "".join(text), usage


def _migrated(up: Up) -> float:
    metrics = httpx.get(up.url + "/metrics", timeout=5).text
    return float(re.search(r"^pdserve_router_migrated_streams_total (\S+)", metrics, re.M)[1])  # type: ignore[index]


@pytest.mark.parametrize(
    "prompt,sampling",
    [(LONG, {}), ("Once upon a time", {}), (LONG, {"temperature": 0.9, "seed": 11})],
    ids=["greedy-remote-prefill", "greedy-local-prefill", "seeded"],
)
def test_stream_survives_kill_of_its_decode_worker(up: Up, prompt: str, sampling: dict) -> None:
    _all_back(up, decode=2)  # one to kill, one to take over; the third may be restarting
    before = _migrated(up)
    ref = httpx.post(up.url + "/v1/completions", json=_body(prompt, **sampling), timeout=120)
    assert ref.status_code == 200
    ref_text = ref.json()["choices"][0]["text"]
    text, tokens = _stream_text(up, _body(prompt, **sampling), kill_after=20)
    assert tokens == MAX_TOKENS
    assert text == ref_text  # no token repeated, none missing, same choices
    assert _migrated(up) == before + 1


def test_non_streamed_request_survives_kill_of_its_decode_worker(up: Up) -> None:
    _all_back(up, decode=2)
    body = _body(LONG)
    ref = httpx.post(up.url + "/v1/completions", json=body, timeout=120).json()
    out: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: out.update(r=httpx.post(up.url + "/v1/completions", json=body, timeout=120))
    )
    t.start()
    _kill_busy(up.urls("decode"))
    t.join(120)
    assert out["r"].status_code == 200, out["r"].text
    got = out["r"].json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == MAX_TOKENS


def test_prefill_worker_killed_under_load_costs_no_request(up: Up) -> None:
    # the prefill worker and two decode workers: the one killed last may restart meanwhile
    _all_back(up, decode=2)
    codes: list[int] = []
    killed = threading.Event()

    # clients send back to back until the kill (then one request more each): a prefill
    # finishes in milliseconds, so a fixed burst could be over before a poll sees it
    def client(i: int) -> None:
        for k in range(200):
            body = _body(f"request {i}.{k}: " + LONG, max_tokens=8)
            codes.append(httpx.post(up.url + "/v1/completions", json=body, timeout=120).status_code)
            if killed.is_set() and k > 0:
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        _kill_busy(up.urls("prefill"))
    finally:
        killed.set()
        for t in threads:
            t.join(120)
    assert len(codes) >= 16 and codes == [200] * len(codes)


def test_up_restarts_the_dead_worker_and_it_serves_again(up: Up) -> None:
    _all_back(up)
    victim = up.urls("decode")[0]
    pid = _stats(victim)["pid"]
    os.kill(pid, signal.SIGKILL)
    # the survivors serve meanwhile (the router has not even noticed yet)
    for i in range(6):
        r = httpx.post(up.url + "/v1/completions", json=_body(f"{i} hi", max_tokens=4), timeout=60)
        assert r.status_code == 200, r.text
    _all_back(up)
    assert _stats(victim)["pid"] != pid and up.proc.poll() is None
    assert any("restarted decode-" in x for x in up.lines)

    def served() -> float:
        m = httpx.get(victim + "/metrics", timeout=5).text
        return sum(
            float(x.split()[-1])
            for x in m.splitlines()
            if x.startswith("pdserve_worker_requests_total")
        )

    for i in range(6):  # round-robin: the restarted worker gets its share
        r = httpx.post(up.url + "/v1/completions", json=_body(f"{i} ho", max_tokens=4), timeout=60)
        assert r.status_code == 200, r.text
    assert served() >= 2
    all_kv_free(up.workers)


def _core_pid(url: str) -> int:
    """The worker's engine core (its child, or forked by the core zygote), as it says."""
    core = int(_stats(url)["core_pid"])
    cmdline = Path(f"/proc/{core}/cmdline").read_bytes()
    assert b"core.main" in cmdline or b"core.zygote" in cmdline, cmdline
    return core


@pytest.mark.parametrize("what", ["worker", "core"])
def test_stream_survives_a_hung_decode_worker(up: Up, what: str) -> None:
    """SIGSTOP closes nothing: without the stall cut the stream would wait 600 s."""
    _all_back(up, decode=2)
    before = _migrated(up)
    body = _body(LONG)
    ref_text = httpx.post(up.url + "/v1/completions", json=body, timeout=120).json()
    stopped: list[int] = []

    def hang() -> None:  # once the stream is under way: stop the worker that serves it
        deadline = time.monotonic() + 30
        while not stopped and time.monotonic() < deadline:
            for url in up.urls("decode"):
                s = _stats_or_none(url)
                if s is not None and s["running"]:
                    pid = int(s["pid"])
                    core = _core_pid(url)
                    if what == "worker":  # front end and core: its process group, and the
                        stopped.append(-os.getpgid(pid))  # core the zygote forked outside it
                    stopped.append(core)  # "core": the front end answers, the core is silent
                    for target in stopped:
                        _signal(target, signal.SIGSTOP)
                    return
            time.sleep(0.005)

    def resume() -> None:  # the core first: a front end resumed first may find it silent
        for pid in reversed(stopped):  # past --core-kill-timeout and kill it under our SIGCONT
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile: restarted
                _signal(pid, signal.SIGCONT)
        stopped.clear()

    body = {**body, "stream": True}
    text, started, hung = [], time.monotonic(), []
    try:
        for chunk in sse_chunks(up.url + "/v1/completions", body):
            text += [c["text"] for c in chunk.get("choices", [])]
            if len(text) == 20:
                hang()
                hung = list(stopped)
            elif stopped and len(text) > 20 and _migrated(up) > before:
                resume()  # the stream has moved: the rest of it comes from another worker
        took = time.monotonic() - started
    finally:
        resume()
    assert hung, "no decode worker was running the request"
    assert "".join(text) == ref_text["choices"][0]["text"]
    assert _migrated(up) == before + 1
    assert took < 60, f"the stream took {took:.0f}s"
    metrics = httpx.get(up.url + "/metrics", timeout=5).text
    assert re.search(r'^pdserve_router_stalled_streams_total\{role="decode"\} [1-9]', metrics, re.M)
    _all_back(up)  # resumed, it is healthy again (and was not restarted)
    all_kv_free(up.workers)


def _signal(pid: int, sig: int) -> None:
    if pid < 0:
        signal_group(-pid, sig)
    else:
        os.kill(pid, sig)


def test_a_core_hung_for_good_is_killed_and_its_worker_restarted(up: Up) -> None:
    """--core-stall-timeout=4: /health fails after 4 s; --core-kill-timeout=10: the core is
    killed after 10 s, the worker exits and ``up`` starts it again."""
    _all_back(up)
    victim = up.urls("decode")[-1]
    pid = _stats(victim)["pid"]
    core = _core_pid(victim)
    os.kill(core, signal.SIGSTOP)
    try:
        # 4 s to fail /health, 10 s to the kill, then a whole worker start: 15-30 s alone,
        # 60+ s beside the other xdist worker's clusters on 2 cores (a make test run met 60).
        # A worker that is never killed or never restarted still fails here.
        deadline = time.monotonic() + 150
        while (s := _stats_or_none(victim)) is None or s["pid"] == pid:
            assert time.monotonic() < deadline, "the hung worker was not restarted"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed: gone
            os.kill(core, signal.SIGCONT)
    said = re.findall(r"engine core hung \(silent (\d+)s", "\n".join(_log(up, victim)))
    assert said, "no 'engine core hung' in the worker's log"
    assert 10 <= int(said[-1]) < 16  # --core-kill-timeout, not the default 4 x 4 s
    _all_back(up)
    r = httpx.post(up.url + "/v1/completions", json=_body("hi", max_tokens=4), timeout=60)
    assert r.status_code == 200, r.text
    all_kv_free(up.workers)


def _log(up: Up, url: str) -> list[str]:
    name = next(n for n, u in up.named.items() if u == url)
    return [*up.lines, *(Path(up.log_dir) / f"{name}.log").read_text().splitlines()]
