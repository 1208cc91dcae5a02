"""The tiny test model: deterministic, loads offline, sane tokenizer, sharp logits."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine import tiny_model
from pdserve.engine.tiny_model import MARKER, count_parameters, write_tiny_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TEXTS = [
    "def main():\n    return 42\n",
    "Grüße, señor — ça va? naïve café",
    "日本語のテキスト、中文文本，한국어",
    "emoji 😀🚀👍🏽❤️ and a zero-width joiner 👩‍👩‍👧",
    "  leading spaces and\ttabs\r\nCRLF",
    "<|im_start|> is special only as a token, not inside ordinary text?",
]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_deterministic_for_a_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = write_tiny_model(tmp_path / "again", preset="tiny", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _digest(again / name) == _digest(tiny_model_dir / name), name
    other = write_tiny_model(tmp_path / "other", preset="tiny", seed=1)
    assert _digest(other / "model.safetensors") != _digest(tiny_model_dir / "model.safetensors")
    assert _digest(other / "tokenizer.json") == _digest(tiny_model_dir / "tokenizer.json")


def test_idempotent_and_replaces_other_seed(tiny_model_dir: Path, tmp_path: Path) -> None:
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    assert write_tiny_model(tiny_model_dir, preset="tiny", seed=0) == tiny_model_dir
    assert time.monotonic() - start < 1.0
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before
    out = write_tiny_model(tmp_path / "m", preset="tiny", seed=1)
    write_tiny_model(out, preset="tiny", seed=2)
    assert json.loads((out / MARKER).read_text())["seed"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left"


def test_loads_offline_through_auto_classes(tiny_model_dir: Path) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads  # GQA path exercised
    assert len(tok) == config.vocab_size
    assert tok.eos_token_id == config.eos_token_id == model.generation_config.eos_token_id
    assert tok.bos_token_id == config.bos_token_id
    assert tok.pad_token_id == config.pad_token_id
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    ids = tok("hello world").input_ids
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tiny_tokenizer, text: str) -> None:
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert tiny_tokenizer.decode(ids) == text
    assert all(0 <= i < len(tiny_tokenizer) for i in ids)


def test_multibyte_characters_get_merged_tokens(tiny_tokenizer) -> None:
    # The corpus includes multilingual text, so some CJK characters are single tokens
    # and others are split across byte tokens: both cases the detokenizer must handle.
    ids = tiny_tokenizer("日本語のテキスト 😀", add_special_tokens=False).input_ids
    pieces = [tiny_tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # some token is a partial character
    assert len(ids) < len("日本語のテキスト 😀".encode())  # but merges exist


def test_chat_template_renders(tiny_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ✨"},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ✨<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith("assistant\n")
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tiny_tokenizer.bos_token_id) == 1
    assert ids.count(tiny_tokenizer.eos_token_id) == 2  # <|im_end|> is one token


def test_parameter_counts_per_preset(tiny_model_dir: Path) -> None:
    tiny = count_parameters("tiny")
    assert 1_000_000 <= tiny <= 5_000_000
    assert json.loads((tiny_model_dir / MARKER).read_text())["num_parameters"] == tiny
    assert 20_000_000 <= count_parameters("small") <= 80_000_000


def test_greedy_logits_are_sharp(tiny_model_dir: Path, tiny_tokenizer) -> None:
    """Greedy outputs are the engine's oracle: top-1 vs top-2 gaps must not be near-ties."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gaps, outputs = [], set()
    for prompt in ["def main():", "日本語 😀", "The quick brown fox", "a"]:
        ids = tiny_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=32,
                do_sample=False,
                return_dict_in_generate=True,
                output_logits=True,
            )
        outputs.add(tuple(out.sequences[0, ids.shape[1] :].tolist()))
        for logits in out.logits:
            top = logits[0].topk(2).values
            gaps.append(float(top[0] - top[1]))
    gaps.sort()
    assert len(outputs) == 4  # different prompts, different continuations
    assert gaps[0] > 1e-4, gaps[:5]
    assert gaps[len(gaps) // 2] > 0.1


def test_bad_input_gets_clear_errors(tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        write_tiny_model(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="seed"):
        write_tiny_model(tmp_path / "x", seed=-1)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    args = argparse.Namespace(dir=str(busy), preset="tiny", seed=0)
    assert tiny_model.run(args) == 2
    assert "not empty" in capsys.readouterr().out
    assert (busy / "notes.txt").read_text() == "mine"
