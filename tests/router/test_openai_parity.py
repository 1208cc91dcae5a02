"""OpenAI API parity through ``pdserve up`` (1P+1D, float32) with the official client:
logprobs against transformers, penalties, logit_bias, /tokenize, /detokenize, and 400s
naming the field. Every prompt is long enough to cross the P/D hand-off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from pdserve.testing.loopback import all_kv_free
from tests.router.pdserve_up import Up, four_choices, worker_stats

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT_IDS = [0, *range(400, 440)]  # 41 tokens: remote prefill
LONG_TEXT = "Tell me a story about a fox and a crow. " * 4


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _chat_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _hf_logprobs(hf: Any, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] float32 log-softmax of transformers' logits at each output position."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def _check(hf_lp: torch.Tensor, ids: list[int], chosen: list[float], tops: list[dict]) -> None:
    assert len(ids) == len(chosen) == len(tops) == hf_lp.shape[0]
    for pos, (tok, lp, top) in enumerate(zip(ids, chosen, tops, strict=True)):
        assert abs(lp - float(hf_lp[pos, tok])) < 1e-4, (pos, lp, float(hf_lp[pos, tok]))
        want = hf_lp[pos].topk(len(top))
        got = sorted(top.items(), key=lambda kv: -kv[1])
        assert [int(k.removeprefix("token_id:")) for k, _ in got] == want.indices.tolist()
        assert max(abs(v - w) for (_, v), w in zip(got, want.values.tolist(), strict=True)) < 1e-4


def _complete(client: openai.OpenAI, max_tokens: int, **kw: Any) -> Any:
    """A completion of PROMPT_IDS that runs to ``max_tokens`` (ignore_eos); ``kw``: the
    call's other fields, its ``extra_body`` merged over ignore_eos."""
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client.completions.create(
        model="tiny-seed0", prompt=PROMPT_IDS, max_tokens=max_tokens, extra_body=extra, **kw
    )


AS_IDS = {"return_tokens_as_token_ids": True}


def test_completion_logprobs_match_transformers(client: openai.OpenAI, hf: Any) -> None:
    kw: dict[str, Any] = dict(temperature=1.0, seed=5, logprobs=5, extra_body=AS_IDS)
    out = _complete(client, 10, **kw)
    lp = out.choices[0].logprobs
    ids = _ids(lp.tokens)
    _check(_hf_logprobs(hf, PROMPT_IDS, ids), ids, lp.token_logprobs, lp.top_logprobs)
    # Streamed: the same tokens (same seed), the first one's logprobs from the prefill worker.
    chunks = list(_complete(client, 10, stream=True, **kw))
    s_tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    s_lps = [x for c in chunks if c.choices for x in c.choices[0].logprobs.token_logprobs]
    s_tops = [x for c in chunks if c.choices for x in c.choices[0].logprobs.top_logprobs]
    assert _ids(s_tokens) == ids
    _check(_hf_logprobs(hf, PROMPT_IDS, ids), ids, s_lps, s_tops)


def test_chat_logprobs_match_transformers(
    client: openai.OpenAI, hf: Any, tiny_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": LONG_TEXT}]
    prompt = _chat_ids(tiny_tokenizer, messages)
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model="tiny-seed0",
            messages=messages,
            max_tokens=8,
            temperature=0.0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        )
        if stream:
            content = [
                e
                for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content
            ]
        else:
            content = client.chat.completions.create(**kw).choices[0].logprobs.content
        ids = _ids([e.token for e in content])
        tops = [{t.token: t.logprob for t in e.top_logprobs} for e in content]
        _check(_hf_logprobs(hf, prompt, ids), ids, [e.logprob for e in content], tops)


def test_logit_bias_forces_its_token(client: openai.OpenAI, tiny_tokenizer: Any) -> None:
    out = _complete(
        client, 6, temperature=1.0, logit_bias={"1234": 100}, logprobs=0, extra_body=AS_IDS
    )
    assert _ids(out.choices[0].logprobs.tokens) == [1234] * 6
    assert out.choices[0].text == tiny_tokenizer.decode([1234] * 6)


def test_each_penalty_changes_greedy_output(client: openai.OpenAI) -> None:
    def run(**extra: Any) -> str:
        return str(_complete(client, 150, temperature=0.0, extra_body=extra).choices[0].text)

    base = run()
    for field, value in [
        ("presence_penalty", 2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 3.0),
    ]:
        assert run(**{field: value}) != base, field
    assert run(min_p=0.5) == base  # min_p never changes a greedy pick


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": "a"}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"echo": True, "n": 2}, "echo"),  # echo itself is honoured (tests/router/test_echo.py)
        ({"best_of": 17}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"n": 17}, "n"),
    ],
)
def test_bad_fields_are_refused_by_name(up: Up, body: dict[str, Any], param: str) -> None:
    chat = param == "top_logprobs"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = {"model": "tiny-seed0", "max_tokens": 2, **body}
    req.update(
        {"messages": [{"role": "user", "content": LONG_TEXT}]} if chat else {"prompt": LONG_TEXT}
    )
    r = httpx.post(up.url + path, json=req, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def _prefills(up: Up) -> float:
    text = httpx.get(worker_stats(up, "prefill")["url"] + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("pdserve_worker_requests_total") and 'role="prefill"' in line
    )


def _decode_hits(up: Up) -> int:
    return int(worker_stats(up, "decode")["prefix_cache_hit_tokens"])


def test_n_choices_share_one_prefill(client: openai.OpenAI, up: Up) -> None:
    prefills, hits = _prefills(up), _decode_hits(up)
    out = four_choices(client, "tiny-seed0")
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1  # each choice samples on its own
    assert out.usage.completion_tokens == 32 and out.usage.prompt_tokens == 41
    assert _prefills(up) == prefills + 1  # one prefill for the four choices
    assert _decode_hits(up) - hits >= 3 * 32  # choices 1-3 reuse the transferred blocks
    # Streamed chat: every choice's chunks carry its index; each finishes once.
    stream = client.chat.completions.create(
        model="tiny-seed0",
        n=3,
        max_tokens=5,
        messages=[{"role": "user", "content": LONG_TEXT}],
        stream=True,
        temperature=1.0,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
    )
    text: dict[int, str] = {}
    finished: list[int] = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(finished) == [0, 1, 2] and set(text) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == 15
    all_kv_free(up.workers)


def test_best_of_returns_the_most_likely(client: openai.OpenAI) -> None:
    every = _complete(client, 6, temperature=1.0, seed=21, n=3, logprobs=0).choices  # the same 3
    sums = {c.text: sum(c.logprobs.token_logprobs) for c in every}
    best = _complete(client, 6, temperature=1.0, seed=21, n=1, best_of=3).choices
    assert len(best) == 1 and best[0].logprobs is None  # not asked for: not shown
    assert best[0].text == max(sums, key=lambda t: sums[t])


def test_tokenize_and_detokenize(up: Up, tiny_tokenizer: Any) -> None:
    r = httpx.post(up.url + "/tokenize", json={"model": "tiny-seed0", "prompt": LONG_TEXT})
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["tokens"] == tiny_tokenizer.encode(LONG_TEXT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(up.url + "/tokenize", json={"model": "tiny-seed0", "messages": messages})
    assert r.json()["tokens"] == _chat_ids(tiny_tokenizer, messages)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(
        up.url + "/tokenize", json={"messages": messages, "tools": tools}
    ).json()
    assert with_tools["count"] > r.json()["count"]  # the default tools prompt is counted
    r = httpx.post(up.url + "/detokenize", json={"model": "tiny-seed0", "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tiny_tokenizer.decode(body["tokens"])}
    bad = httpx.post(up.url + "/detokenize", json={"model": "tiny-seed0", "tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    models = httpx.get(up.url + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == 1024


def test_all_kv_blocks_free(up: Up) -> None:
    all_kv_free(up.workers)
    assert json.loads(httpx.get(up.url + "/health").text)["status"] == "ok"
