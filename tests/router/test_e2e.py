"""End to end with the real workers: ``pdserve up`` on loopback, the official client,
a load of 200 requests at concurrency 50, and every KV block free afterwards."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.local.proc_group import end_group, signal_group
from pdserve.testing.loopback import ROOT, all_kv_free
from pdserve.testing.up import start_up, suite_flags

WORKERS = [ROOT / "prefill_worker" / "main.py", ROOT / "decode_worker" / "main.py"]

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not all(p.exists() for p in WORKERS), reason="real workers not built yet"),
]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# Its own `pdserve up` (~20 s to start), not the shared one: a disaggregation threshold
# that sends short prompts to local prefill and long ones to the prefill worker (the
# metrics test reads both), and the last test stops it with SIGINT.
@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory):
    """``pdserve up`` as a user runs it; yields (router URL, worker URLs)."""
    logs = tmp_path_factory.mktemp("up-logs")
    # Started as a shell starts a background job: SIGINT ignored (the stop test sends it).
    flags = (*suite_flags(logs), "--disagg-threshold", "32")
    started = start_up(tiny_model_dir, *flags, preexec_fn=_ignore_sigint)
    url, workers, proc = started.url, started.workers, started.proc
    assert len(workers) == 2, workers  # the default: one prefill, one decode worker
    yield url, workers, proc
    end_group(proc, signal.SIGKILL, grace_s=10)


def test_openai_client_against_real_workers(up) -> None:
    url, workers, _ = up
    cl = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = cl.models.list().data[0].id
    long_prompt = "Tell me a story about a fox. " * 20
    greedy = {"model": model, "prompt": long_prompt, "max_tokens": 8, "temperature": 0}
    out = cl.completions.create(**greedy, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    again = cl.completions.create(**greedy, extra_body={"ignore_eos": True})
    assert again.choices[0].text == out.choices[0].text  # greedy: same text, now from cache
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(
        cl.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": long_prompt}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6
    short = cl.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert short.choices[0].message.role == "assistant"
    metrics = httpx.get(url + "/metrics").text
    assert 'kind="remote_prefill"' in metrics and 'kind="local_prefill"' in metrics
    all_kv_free(workers)


def test_load_200_requests_at_concurrency_50(up) -> None:
    url, workers, _ = up

    async def load() -> list[int]:
        sem = asyncio.Semaphore(50)
        async with httpx.AsyncClient(base_url=url, timeout=600) as h:

            async def one(i: int) -> int:
                body = {
                    "model": "tiny-seed0",
                    "prompt": f"request {i}: " + "word " * (i % 60),
                    "max_tokens": 8,
                }
                async with sem:
                    r = await h.post("/v1/completions", json=body)
                    return r.status_code

            return await asyncio.gather(*(one(i) for i in range(200)))

    codes = asyncio.run(load())
    assert codes == [200] * 200
    all_kv_free(workers)


def test_sigint_stops_everything(up) -> None:
    url, workers, proc = up
    signal_group(proc, signal.SIGINT)  # Ctrl-C; SIGTERM is tested by the autoscale test
    assert proc.wait(60) == 0
    for target in [url, *workers]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(target + "/health", timeout=2)
