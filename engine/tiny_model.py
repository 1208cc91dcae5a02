"""``pdserve tiny-model DIR``: a small, random, Llama-style model in HF format.

The model is randomly initialised (seeded) and the byte-level BPE tokenizer is
trained on local text (the Python standard library's sources plus a short
multilingual sample), so nothing is downloaded. Greedy outputs of this model are
the engine's correctness oracle, hence a large ``initializer_range``: sharp
logits make near-ties between the top two tokens rare.

Writing is idempotent: a complete model carries ``pdserve_tiny_model.json``
(written last); asking again for the same preset and seed returns at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = "pdserve_tiny_model.json"
FORMAT_VERSION = 1

BOS = "<|begin_of_text|>"
EOS = "<|im_end|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START)

# ChatML-like; the turn terminator doubles as EOS so chat replies end cleanly.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gives the BPE merges inside multi-byte characters, which the detokenizer tests need.
MULTILINGUAL_SAMPLE = (
    "Grüße aus Köln, señor! Ça va très bien, merci. Ελληνικά κείμενα. Русский текст. "
    "日本語のテキストです。中文文本，你好世界。한국어 텍스트. עברית. العربية. "
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ ✨ — “quotes” and ‘more’ … €100, £5, ¥300, ½, π ≈ 3.14159.\n"
)


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    corpus_chars: int  # tokenizer training text budget
    initializer_range: float = 0.2


# One row a preset, Preset's fields in order: vocabulary, hidden size, layers, attention
# heads, KV heads, MLP size, max positions, tokenizer corpus chars.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(3072, 128, 4, 4, 2, 256, 2048, 1_500_000),
    "small": Preset(8192, 512, 8, 8, 4, 1408, 4096, 3_000_000),
}


def training_corpus(max_chars: int) -> list[str]:
    """A fixed, sorted selection of the stdlib's top-level modules, up to ``max_chars``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [MULTILINGUAL_SAMPLE * 20]
    total = len(texts[0])
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    if total < max_chars // 10:
        raise RuntimeError(f"too little local text under {stdlib} to train a tokenizer")
    return texts


def train_tokenizer(vocab_size: int, corpus_chars: int, model_max_length: int):  # -> fast tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(corpus_chars), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def make_config(preset: Preset, vocab_size: int, special_ids: dict[str, int]):  # -> LlamaConfig
    from transformers import LlamaConfig

    # the preset's fields are LlamaConfig's, but for the vocabulary the tokenizer trained to
    shape = {k: v for k, v in asdict(preset).items() if k not in ("vocab_size", "corpus_chars")}
    return LlamaConfig(
        vocab_size=vocab_size,
        **shape,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=special_ids[BOS],
        eos_token_id=special_ids[EOS],
        pad_token_id=special_ids[PAD],
        dtype="float32",
    )


def build_model(preset: Preset, vocab_size: int, special_ids: dict[str, int], seed: int):
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = make_config(preset, vocab_size, special_ids)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[BOS],
        eos_token_id=special_ids[EOS],
        pad_token_id=special_ids[PAD],
        do_sample=False,
    )
    return model


def count_parameters(preset_name: str) -> int:
    """Parameter count of a preset, computed on the meta device (no memory, no training)."""
    import torch
    from transformers import LlamaForCausalLM

    preset = PRESETS[preset_name]
    ids = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    with torch.device("meta"):
        model = LlamaForCausalLM(make_config(preset, preset.vocab_size, ids))
    return sum(p.numel() for p in model.parameters())


def is_complete(out_dir: Path, preset: str, seed: int) -> bool:
    try:
        meta = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        meta.get("preset") == preset
        and meta.get("seed") == seed
        and (meta.get("format_version") == FORMAT_VERSION)
    )


def _write_into(tmp: Path, preset_name: str, seed: int) -> int:
    preset = PRESETS[preset_name]
    print(f"tiny-model: training byte-level BPE tokenizer (vocab {preset.vocab_size})", flush=True)
    tokenizer = train_tokenizer(
        preset.vocab_size, preset.corpus_chars, preset.max_position_embeddings
    )
    special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = len(tokenizer)
    print(f"tiny-model: building Llama model (preset {preset_name}, seed {seed})", flush=True)
    model = build_model(preset, vocab_size, special_ids, seed)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    meta = {
        "format_version": FORMAT_VERSION,
        "preset": preset_name,
        "seed": seed,
        "num_parameters": num_params,
        "vocab_size": vocab_size,
        "special_token_ids": special_ids,
        "preset_config": asdict(preset),
    }
    (tmp / MARKER).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return num_params


def write_tiny_model(out_dir: str | os.PathLike[str], preset: str = "tiny", seed: int = 0) -> Path:
    """Write (or find already written) the model for ``preset``/``seed`` at ``out_dir``.

    Safe against concurrent writers: the model is built in a sibling temporary
    directory and renamed into place, so readers never see a half-written model.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid: {', '.join(sorted(PRESETS))}")
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out_dir).resolve()
    if is_complete(out, preset, seed):
        print(f"tiny-model: {out} already holds preset {preset} seed {seed}", file=sys.stderr)
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} is not empty and does not hold a pdserve tiny model")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        num_params = _write_into(tmp, preset, seed)
        _move_into_place(tmp, out, preset, seed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"tiny-model: wrote {out} ({num_params:,} parameters)", flush=True)
    return out


def _move_into_place(tmp: Path, out: Path, preset: str, seed: int) -> None:
    if out.exists() and is_complete(out, preset, seed):
        return  # a concurrent writer finished first; its bytes equal ours
    if out.exists() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():  # an older model (other preset/seed): swap it out
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "model")
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:
        if not is_complete(out, preset, seed):  # lost a race to a different writer
            raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the weights")


def run(args: argparse.Namespace) -> int:
    try:
        write_tiny_model(args.dir, preset=args.preset, seed=args.seed)
    except (ValueError, FileExistsError) as exc:
        print(f"tiny-model: error: {exc}", flush=True)
        return 2
    return 0
