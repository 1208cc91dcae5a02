"""The load of bench/serve.py: random token prompts at a fixed concurrency, streamed.

Like ``vllm bench serve --dataset-name random``: every request is a prompt of
``input_len`` random token ids, asks for exactly ``output_len`` tokens (greedy,
``ignore_eos``), streams, and reports its usage. TTFT is the time to the first
token; TPOT is (latency - TTFT) / (output tokens - 1) per request; output tok/s is
all output tokens over the wall time of the point.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from lib.completions import greedy_stream
from lib.stats import percentile


@dataclass(frozen=True)
class Load:
    num_prompts: int
    input_len: int
    output_len: int
    vocab: int = 3000  # token ids are drawn from [10, vocab): valid for every preset
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        return [
            [rng.randrange(10, self.vocab) for _ in range(self.input_len)]
            for _ in range(self.num_prompts)
        ]


@dataclass
class Sample:
    ttft: float
    latency: float
    output_tokens: int


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], out_len: int
) -> Sample:
    body = greedy_stream(model, prompt, out_len)
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk: dict[str, Any] = json.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    latency = time.perf_counter() - start
    if tokens != out_len:
        raise RuntimeError(f"{url}: asked for {out_len} tokens, got {tokens}")
    return Sample(ttft if ttft is not None else latency, latency, tokens)


async def run_point(url: str, model: str, load: Load, concurrency: int) -> dict[str, float]:
    """All prompts at ``concurrency`` in flight; the point's summary."""
    prompts = load.prompts()
    queue = list(reversed(prompts))
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                samples.append(await _one(session, url, model, prompt, load.output_len))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(samples, wall, concurrency)


def _pct(values: list[float], p: float) -> float:
    return percentile(values, p / 100)


def summarize(samples: list[Sample], wall: float, concurrency: int) -> dict[str, float]:
    out_tokens = sum(s.output_tokens for s in samples)
    ttft = [s.ttft * 1e3 for s in samples]
    tpot = [
        (s.latency - s.ttft) / (s.output_tokens - 1) * 1e3 for s in samples if s.output_tokens > 1
    ] or [0.0]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "output_tok_s": round(out_tokens / wall, 2),
        "ttft_p50_ms": round(_pct(ttft, 50), 2),
        "ttft_p99_ms": round(_pct(ttft, 99), 2),
        "tpot_p50_ms": round(_pct(tpot, 50), 2),
        "tpot_p99_ms": round(_pct(tpot, 99), 2),
        "wall_s": round(wall, 3),
    }


async def served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/v1/models") as resp:
        data = await resp.json()
    return str(data["data"][0]["id"])


async def warm_up(url: str, model: str, load: Load) -> None:
    """A few requests first, so neither server's first-call costs land in a point."""
    warm = Load(2, load.input_len, min(load.output_len, 4), load.vocab, seed=load.seed + 1)
    await run_point(url, model, warm, 2)
