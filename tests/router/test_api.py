"""The OpenAI API through the official client, against fake workers.

The fake workers (pdserve/testing/router_fakes.py) stand in for the real prefill and
decode workers, following docs/architecture.md's worker API exactly.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LONG = "The quick brown fox jumps over the lazy dog. " * 40  # well over the threshold


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


async def stream_long(url: str, max_tokens: int) -> tuple[list[Any], list[str]]:
    """A streamed completion of LONG with its usage chunk: (chunks, each choice chunk's text)."""
    stream = await client(url).completions.create(
        model="tiny",
        prompt=LONG,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [ch async for ch in stream]
    return chunks, [ch.choices[0].text for ch in chunks if ch.choices]


async def test_completion_non_streaming_remote_prefill(cluster_factory) -> None:
    async with cluster_factory(disagg_threshold=32) as c:
        out = await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=5)
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].text.startswith("<") and out.choices[0].text.endswith(" t3")
        assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 32
        # the prefill worker's cache counts (a miss), not the decode side's
        assert out.usage.prompt_tokens_details.cached_tokens == 0
        assert out.id.startswith("cmpl-") and out.model == "tiny"
        assert len(c.prefill[0].requests) == 1 and c.decode[0].requests[0].kv_handle
        assert c.decode[0].requests[0].first_token_id is not None
        await c.settle()


async def test_completion_short_prompt_goes_straight_to_decode(cluster_factory) -> None:
    async with cluster_factory(disagg_threshold=10_000) as c:
        out = await client(c.url).completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert out.choices[0].text == " t0 t1 t2"
        assert c.prefill[0].requests == []
        assert out.usage.prompt_tokens_details.cached_tokens == 7  # the decode worker's count
        assert c.decode[0].requests[0].kv_handle is None
        await c.settle()


async def test_completion_streaming_with_usage(cluster_factory) -> None:
    async with cluster_factory(disagg_threshold=32) as c:
        chunks, texts = await stream_long(c.url, 4)
        # the prefill's token first, on its own; decode tokens that arrive together may
        # share a chunk (the router catches up instead of paying per token)
        assert texts[0].startswith("<") and "".join(texts[1:]) == " t0 t1 t2" and all(texts)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        await c.settle()


async def test_chat_non_streaming_and_streaming(cluster_factory) -> None:
    async with cluster_factory(disagg_threshold=10_000) as c:
        cl = client(c.url)
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        out = await cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=3)
        assert out.choices[0].message.role == "assistant"
        assert out.choices[0].message.content == " t0 t1 t2"
        assert out.object == "chat.completion" and out.usage.total_tokens > 3
        # the router applied the model's chat template before tokenizing
        ids = c.decode[0].requests[0].prompt_token_ids
        text = c.runtime.tokenizer.tok.decode(ids)
        assert "<|im_start|>assistant" in text and "hello" in text
        stream = await cl.chat.completions.create(
            model="tiny", messages=msgs, max_completion_tokens=2, stream=True
        )
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == " t0 t1"
        assert chunks[-1].choices[0].finish_reason == "length"
        await c.settle()


async def test_chat_remote_prefill_streams_first_token(cluster_factory) -> None:
    async with cluster_factory(disagg_threshold=8) as c:
        stream = await client(c.url).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=3, stream=True
        )
        contents = [ch.choices[0].delta.content async for ch in stream if ch.choices]
        assert contents[1].startswith("<") and "".join(contents[2:]) == " t0 t1"
        assert all(contents[1:])
        await c.settle()


async def test_token_id_prompt_and_max_tokens_one(cluster_factory) -> None:
    async with cluster_factory(disagg_threshold=16) as c:
        out = await client(c.url).completions.create(
            model="tiny", prompt=list(range(5, 60)), max_tokens=1
        )
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 1
        assert c.decode[0].requests == []  # finished at prefill, no decode needed
        assert c.prefill[0].requests[0].prompt_token_ids == list(range(5, 60))
        await c.settle()


async def test_models_health_workers_metrics(cluster_factory) -> None:
    async with cluster_factory(n_prefill=2, n_decode=1) as c:
        models = await client(c.url).models.list()
        assert [m.id for m in models.data] == ["tiny"]
        async with httpx.AsyncClient(base_url=c.url) as h:
            assert (await h.get("/health")).json()["status"] == "ok"
            workers = (await h.get("/workers")).json()["workers"]
            assert sorted(w["role"] for w in workers) == ["decode", "prefill", "prefill"]
            assert all(w["healthy"] and w["kv_blocks_total"] == 1000 for w in workers)
            await client(c.url).completions.create(model="tiny", prompt=LONG, max_tokens=3)
            text = (await h.get("/metrics")).text
        for name in (
            "pdserve_router_ttft_seconds_bucket",
            "pdserve_router_e2e_seconds_count",
            "pdserve_router_itl_seconds",
            "pdserve_router_tpot_seconds",
            'pdserve_router_requests_total{code="200"} 1.0',
            'pdserve_router_routing_decisions_total{kind="remote_prefill"} 1.0',
            "pdserve_router_prefix_match_ratio_bucket",
            "pdserve_router_inflight_requests{",
            "pdserve_router_queue_depth 0.0",
            "pdserve_router_prefill_queue_depth 0.0",  # back to 0 after the first token
        ):
            assert name in text, name
        await c.settle()
