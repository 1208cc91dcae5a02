"""Evaluation harnesses against ``pdserve up`` (1 prefill + 1 decode worker, float32):
``echo`` + ``logprobs``, ``max_tokens: 0``, vLLM's ``prompt_logprobs``, and
lm-evaluation-harness's ``local-completions`` model on a small multiple-choice task.

The reference is transformers' own forward of the same tokens: a continuation's
loglikelihood read from the echoed prompt must equal it within 1e-4. Prompts of at
least 8 tokens are prefilled on the prefill worker (the prompt logprobs travel with
the first token in the prefill reply); shorter ones on the decode worker (they travel
on its first stream line); a repeated prompt would hit the prefix cache, which such
requests bypass (the test sends each twice).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pdserve.testing.loopback import all_kv_free, sse_chunks
from tests.router.pdserve_up import Up

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def _hf_logprobs(hf: Any, ids: list[int]) -> list[float]:
    """Per token 1..n-1: its logprob given the tokens before it."""
    with torch.inference_mode():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(lp[p, ids[p + 1]]) for p in range(len(ids) - 1)]


def _model(up: Up) -> str:
    return str(httpx.get(up.url + "/v1/models").json()["data"][0]["id"])


def _post(up: Up, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(up.url + "/v1/completions", json={"model": _model(up), **body}, timeout=120)


def _decisions(up: Up, kind: str) -> float:
    for line in httpx.get(up.url + "/metrics").text.splitlines():
        if line.startswith("pdserve_router_") and f'kind="{kind}"' in line and "_total" in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("context_len", [40, 2])  # P/D hand-off; local prefill (< 8 tokens)
def test_echo_loglikelihood_equals_transformers(up: Up, hf: Any, context_len: int) -> None:
    rng = random.Random(context_len)
    context = [rng.randrange(3, 3000) for _ in range(context_len)]
    continuation = [rng.randrange(3, 3000) for _ in range(5)]
    ids = context + continuation
    want = sum(_hf_logprobs(hf, ids)[context_len - 1 :])
    kind = "remote_prefill" if context_len >= 8 else "local_prefill"
    before = _decisions(up, kind)
    for _ in range(2):  # the second one's prefix is cached on the workers
        # lm-eval 0.4.13's loglikelihood payload, byte for byte (openai_completions.py), so
        # CI runs the harness's shape even where lm_eval is not installed
        body = {
            "prompt": [ids],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        resp = _post(up, body)
        assert resp.status_code == 200, resp.text
        lps = resp.json()["choices"][0]["logprobs"]
        assert len(lps["tokens"]) == len(ids) + 1  # the prompt, then the generated token
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        got = sum(lps["token_logprobs"][context_len:-1])  # what lm-eval reads
        assert abs(got - want) < TOL, (got, want)
        tops = lps["top_logprobs"][context_len:-1]  # its is_greedy: each token the top one
        assert all(len(top) == 1 for top in tops)
        assert lps["text_offset"] == sorted(lps["text_offset"])
    assert _decisions(up, kind) >= before + 2  # the path the parameter names was taken
    all_kv_free(up.workers)


def test_max_tokens_zero_scores_the_prompt_only(up: Up, hf: Any, tiny_tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog, again and again."
    ids = tiny_tokenizer(text).input_ids
    resp = _post(up, {"prompt": text, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    lps = choice["logprobs"]
    assert len(lps["token_logprobs"]) == len(ids) and lps["token_logprobs"][0] is None
    for got, want in zip(lps["token_logprobs"][1:], _hf_logprobs(hf, ids), strict=True):
        assert abs(got - want) < TOL
    assert all(len(top) == 2 for top in lps["top_logprobs"][1:])


def test_prompt_logprobs_vllm_shape(up: Up, hf: Any) -> None:
    ids = list(range(100, 120))
    resp = _post(up, {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) and choice["logprobs"] is None
    for p, (entry, want) in enumerate(zip(plp[1:], _hf_logprobs(hf, ids), strict=True)):
        token = entry[str(ids[p + 1])]
        assert abs(token["logprob"] - want) < TOL and token["rank"] >= 1
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:3] == [1, 2, 3]  # the top 3, plus the prompt token when not among them


def test_echo_streamed_equals_whole(up: Up) -> None:
    body = {
        "model": _model(up),
        "prompt": "Once upon a time in a land far away",
        "echo": True,
        "logprobs": 1,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    whole = _post(up, body).json()["choices"][0]
    chunks = list(sse_chunks(up.url + "/v1/completions", {**body, "stream": True}))
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == body["prompt"]  # the first chunk is the echoed prompt
    assert "".join(texts) == whole["text"]
    streamed = [x for c in chunks if c["choices"] for x in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == whole["logprobs"]["tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "echo": True, "n": 2}, "echo"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "echo": "yes"}, "echo"),
        ({"prompt": "hi", "suffix": "end"}, "suffix"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ],
)
def test_refused_by_name(up: Up, body: dict[str, Any], param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(up.url + path, json={"model": _model(up), **body}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


MC_TASK = """task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
MC_DOCS = [
    {
        "question": "The capital of France is",
        "choices": [" Paris", " Rome", " Berlin"],
        "answer": 0,
    },
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
]


def test_lm_eval_local_completions(up: Up, hf: Any, tiny_model_dir: Path, tmp_path: Path):
    """lm-evaluation-harness's own client (``local-completions``), its own task loader
    and its own loglikelihood parsing, end to end; each answer's loglikelihood equals
    transformers' on the tokens lm-eval sent."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "pdserve_mc.yaml").write_text(MC_TASK.format(data=data))
    lm = LocalCompletionsAPI(
        base_url=up.url + "/v1/completions",
        model=_model(up),
        tokenizer=str(tiny_model_dir),
        max_retries=1,
    )
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["pdserve_mc"],
        log_samples=True,
        task_manager=TaskManager(include_path=str(tmp_path)),
    )
    assert "acc,none" in out["results"]["pdserve_mc"]
    samples = out["samples"]["pdserve_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            ctx, cont = lm._encode_pair(context, continuation)
            want = sum(_hf_logprobs(hf, ctx + cont)[len(ctx) - 1 :])
            assert abs(resp[0][0] - want) < TOL, (context, continuation, resp, want)
    all_kv_free(up.workers)
