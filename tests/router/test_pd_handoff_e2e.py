"""``--pd-handoff decode`` with the real workers: ``pdserve up`` (1 prefill + 1 decode,
float32) whose router names the prefill worker to the decode worker, which calls it, streams
its first token and pulls the KV over the test transport. Greedy continuations equal
transformers' ``generate()``, three at once; a repeated prompt is served from the prefill
worker's prefix cache and says so in its usage; every KV block is free at the end. The
failover paths (a prefill worker that fails, every one down, a refusal) run against the
fakes in tests/router/test_pd_handoff.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.loopback import all_kv_free
from tests.router.pdserve_up import four_choices, greedy_ids, run_up, worker_stats

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

PROMPTS = [[(i * k + 11) % 3000 + 5 for i in range(40)] for k in (37, 41, 43)]  # P/D: > 8
MAX_TOKENS = 6


async def _greedy(url: str, prompt: list[int]) -> tuple[list[int], int]:
    return await greedy_ids(url, "tiny", prompt, MAX_TOKENS)


def _counter(text: str, prefix: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(prefix))


def test_decode_worker_calls_the_prefill_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    want = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    flags = ("--served-model-name", "tiny", "--router-arg=--pd-handoff=decode")
    with run_up(tiny_model_dir, tmp_path / "logs", *flags) as up:

        async def three() -> list[tuple[list[int], int]]:
            return await asyncio.gather(*(_greedy(up.url, p) for p in PROMPTS))

        got = asyncio.run(three())
        assert [ids for ids, _ in got] == want
        ids, cached = asyncio.run(_greedy(up.url, PROMPTS[0]))  # again: the prefix is cached
        assert ids == want[0] and cached >= 32
        metrics = httpx.get(up.url + "/metrics", timeout=10).text
        decided = 'pdserve_router_routing_decisions_total{kind="remote_prefill"}'
        assert _counter(metrics, decided) >= 4
        # the decode worker made the four prefill calls, and each one came back
        made = "".join(httpx.get(u + "/metrics", timeout=10).text for u in up.workers)
        calls = 'pdserve_worker_prefill_calls_total{outcome="ok",role="decode"}'
        assert _counter(made, calls) == 4, [ln for ln in made.splitlines() if "prefill_c" in ln]
        # n choices: one prefill, and choices 1-3 start once choice 0's KV is on the decode
        # worker (its second token: the first is the prefill's), so each reuses the blocks
        hits = int(worker_stats(up, "decode")["prefix_cache_hit_tokens"])
        out = four_choices(openai.OpenAI(base_url=up.url + "/v1", api_key="none"), "tiny")
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert out.usage.completion_tokens == 32
        after = worker_stats(up, "decode")
        assert int(after["prefix_cache_hit_tokens"]) - hits >= 3 * 32  # 2 full blocks each
        made = "".join(httpx.get(u + "/metrics", timeout=10).text for u in up.workers)
        assert _counter(made, calls) == 5  # the four choices' one prefill call
        all_kv_free(up.workers)
