"""The default deployment, one prefill and one decode worker: the decode worker is killed
(``kill -9``) mid-stream. No other decode worker can take the stream, so the router waits
(``--failover-wait``) while ``pdserve up`` restarts it, then moves the stream there: the
client's text equals an uninterrupted run, with a pause and no error. Every KV pool is
free at the end. Then ``pdserve up`` itself is killed hard: its router and workers end on
their own (local/parent_watch.py), where before they went on holding their ports.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from pdserve.testing.loopback import all_kv_free, secret_auth, sse_chunks
from tests.router.pdserve_up import run_up
from tests.workers.worker_helpers import children, gone

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

BODY = {
    "model": "tiny-seed0",
    "prompt": "Tell me a story about a fox and a crow. " * 4,
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
}


def _stats(url: str) -> dict:
    return dict(httpx.get(url + "/stats", timeout=5, auth=secret_auth()).json())


# One of the suite's slowest (~35 s alone): its own `pdserve up` (--failover-wait), and the
# stream waits on purpose for a real restart of the killed worker (its process start and
# model load) before it goes on: the pause is what the test proves.
def test_stream_waits_for_its_restarted_decode_worker(tiny_model_dir: Path, tmp_path: Path):
    with run_up(tiny_model_dir, tmp_path, "--router-arg=--failover-wait=120") as up:
        decode = next(u for u in up.workers if _stats(u)["role"] == "decode")
        ref = httpx.post(up.url + "/v1/completions", json=BODY, timeout=120).json()
        old_pid = _stats(decode)["pid"]
        text, paused = [], 0.0
        last = time.monotonic()
        body = {**BODY, "stream": True}
        for chunk in sse_chunks(up.url + "/v1/completions", body, timeout=180):
            text += [c["text"] for c in chunk["choices"]]
            now = time.monotonic()
            paused, last = max(paused, now - last), now
            if len(text) == 20:
                os.kill(old_pid, signal.SIGKILL)
        assert "".join(text) == ref["choices"][0]["text"]
        assert _stats(decode)["pid"] != old_pid  # the restarted worker finished it
        print(f"longest pause in the stream: {paused:.1f}s (the restart)")
        all_kv_free(up.workers)
        # pdserve up killed hard (it can stop nothing itself): each child watches it and
        # ends; a worker's core goes with its worker.
        started = children(up.proc.pid)
        assert len(started) >= 3, started  # router, prefill and decode worker (a zygote)
        up.proc.kill()
        up.proc.wait()
        left = [pid for pid in started if not gone(pid, timeout=20.0)]
        assert not left, f"still running after pdserve up was killed: {left}"
