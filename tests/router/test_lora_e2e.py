"""Multi-LoRA through the router, end to end: ``pdserve up --lora`` (1 prefill + 1 decode,
float32), requests naming adapters as their ``model`` through the official client, each
greedy continuation equal to transformers' on PEFT's merged model while the base model and
two adapters run at once; the router's prefix index finds an adapter's blocks on its second
request; an adapter loaded at run time through the router's admin endpoint is served, and
unloaded is a 404; every KV block is free at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.loopback import all_kv_free
from pdserve.testing.lora_adapters import SPECS, merged_model, write_adapter
from tests.router.pdserve_up import greedy_ids, run_up

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

PROMPT = [(i * 37 + 11) % 3000 + 5 for i in range(40)]  # past the disagg threshold: P/D
MAX_TOKENS = 6
KEY = "lora-e2e-key"  # pdserve up: the key is the admin key too (load/unload need one)
AUTH = {"Authorization": f"Bearer {KEY}"}


def _hf_greedy(model: Any) -> list[int]:
    return hf_greedy(model, PROMPT, MAX_TOKENS)


async def _greedy(url: str, model: str) -> tuple[list[int], int]:
    return await greedy_ids(url, model, PROMPT, MAX_TOKENS, KEY)


def _prefix_matched(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    line = next(
        ln for ln in text.splitlines() if ln.startswith("pdserve_router_prefix_match_ratio_sum")
    )
    return float(line.split()[-1])


def test_lora_through_the_router(tiny_model_dir: Path, tmp_path: Path) -> None:
    dirs = {s.name: write_adapter(tiny_model_dir, tmp_path / s.name, s) for s in SPECS}
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    want = {"base": _hf_greedy(base)}
    want.update({n: _hf_greedy(merged_model(tiny_model_dir, d)) for n, d in dirs.items()})
    assert len({tuple(v) for v in want.values()}) == len(want)  # every adapter tells apart
    flags = [f for n in ("attn8", "mlp4") for f in ("--lora", f"{n}={dirs[n]}")]
    with run_up(tiny_model_dir, tmp_path / "logs", *flags, "--api-key", KEY) as up:
        url = up.url
        models = httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
        base_name = models[0]["id"]
        assert [(m["id"], m.get("parent")) for m in models] == [
            (base_name, None),
            ("attn8", base_name),
            ("mlp4", base_name),
        ]

        async def mixed() -> list[tuple[list[int], int]]:
            return await asyncio.gather(*(_greedy(url, m) for m in (base_name, "attn8", "mlp4")))

        got = asyncio.run(mixed())
        assert [ids for ids, _ in got] == [want["base"], want["attn8"], want["mlp4"]]
        before = _prefix_matched(url)
        ids, cached = asyncio.run(_greedy(url, "attn8"))  # again: cached under attn8 only
        assert ids == want["attn8"] and cached >= 32
        assert _prefix_matched(url) > before  # the router's index saw the keyed blocks
        metrics = httpx.get(
            url + "/metrics", headers=AUTH, timeout=10
        ).text  # --lora: resident from start
        assert 'pdserve_router_lora_routed_total{resident="true",role="decode"}' in metrics

        load = {"lora_name": "all16", "lora_path": str(dirs["all16"])}
        r = httpx.post(url + "/v1/load_lora_adapter", json=load, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert asyncio.run(_greedy(url, "all16"))[0] == want["all16"]
        r = httpx.post(
            url + "/v1/unload_lora_adapter", json={"lora_name": "all16"}, headers=AUTH, timeout=60
        )
        assert r.status_code == 200, r.text
        with pytest.raises(openai.NotFoundError):
            asyncio.run(_greedy(url, "all16"))
        all_kv_free(up.workers)
