"""vLLM's chat-template fields on /v1/chat/completions and /tokenize: each one changes the
prompt the workers get, or is refused with a 400 naming it (router/api/chat_options.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from pdserve.router.api.chat_options import ChatTemplateOptions
from pdserve.router.tokenizer import PromptTokenizer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

USER = {"role": "user", "content": "Tell me a story."}
OPENING = {"role": "assistant", "content": "Once upon a time"}


async def _prompt(c, **fields) -> str:
    """The prompt text the decode worker got for a chat request with ``fields``."""
    body = {"model": "tiny", "max_tokens": 2, **fields}
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        r = await h.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ids = c.decode[0].requests[-1].prompt_token_ids
    return str(c.tok.decode(ids))


@pytest.fixture
async def cluster(cluster_factory, router_tokenizer: PromptTokenizer):
    async with cluster_factory(disagg_threshold=10_000) as c:
        c.tok = router_tokenizer.tok
        yield c
        await c.settle()


async def test_add_generation_prompt(cluster) -> None:
    with_header = await _prompt(cluster, messages=[USER])
    without = await _prompt(cluster, messages=[USER], add_generation_prompt=False)
    assert with_header.endswith("<|im_start|>assistant\n")
    assert without.endswith("<|im_end|>\n") and with_header.startswith(without)


async def test_continue_final_message_leaves_the_answer_open(cluster) -> None:
    text = await _prompt(
        cluster, messages=[USER, OPENING], add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nOnce upon a time")  # no <|im_end|>
    closed = await _prompt(cluster, messages=[USER, OPENING], add_generation_prompt=False)
    assert closed.endswith("Once upon a time<|im_end|>\n")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [USER, OPENING], "continue_final_message": True},  # gen. prompt too
            "continue_final_message",
        ),
        (
            {"messages": [USER], "add_generation_prompt": False, "continue_final_message": True},
            "continue_final_message",
        ),  # the last message is not the assistant's
        ({"messages": [USER], "add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"messages": [USER], "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        (
            {"messages": [USER], "chat_template_kwargs": {"chat_template": "{{ 'pwned' }}"}},
            "chat_template_kwargs",
        ),
        ({"messages": [USER], "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
async def test_bad_values_are_refused_naming_the_field(cluster, fields, param) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as h:
            r = await h.post(path, json={"model": "tiny", "max_tokens": 2, **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert cluster.decode[0].requests == []


async def test_tokenize_renders_like_the_chat_endpoint(cluster) -> None:
    fields = {
        "messages": [USER, OPENING],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    text = await _prompt(cluster, **fields)
    async with httpx.AsyncClient(base_url=cluster.url, timeout=30) as h:
        r = await h.post("/tokenize", json=fields)
    sent = cluster.decode[0].requests[-1].prompt_token_ids
    assert r.status_code == 200 and r.json()["tokens"] == sent
    assert cluster.tok.decode(r.json()["tokens"]) == text


def test_chat_template_kwargs_reach_the_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A template with a variable of its own (as Qwen3's ``enable_thinking``)."""
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "config.json":
            shutil.copy(f, tmp_path / f.name)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ 'no-think\\n' }}{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    tok = PromptTokenizer(str(tmp_path))
    plain = tok.tok.decode(tok.encode_chat([USER]))
    off = tok.tok.decode(
        tok.encode_chat(
            [USER], options=ChatTemplateOptions(True, False, {"enable_thinking": False})
        )
    )
    assert "no-think" not in plain and off == plain + "no-think\n"
