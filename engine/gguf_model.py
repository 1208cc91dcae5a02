"""GGUF files (llama.cpp, Ollama) served as HF-format directories, converted once.

transformers reads a GGUF file and dequantizes it; the engine loads a plain HF directory
(config + safetensors + tokenizer). :func:`convert` bridges the two once per file and dtype
and keeps the result in the cache::

    <root>/<sha256[:16]>-<dtype>/<Name>/   config.json, model.safetensors, tokenizer files,
                                           chat template, pdserve_gguf.json (written last)

``<Name>`` is the file's name without its quantization suffix (``SmolLM2-135M-Instruct``),
so the served model name derived from the directory is the model's. The directory is
built under a temporary name and renamed into place: a reader never sees half a model,
and concurrent converters (two workers started with the same file) both end up with one.
A file whose architecture or tensor types transformers cannot read is refused by name
before any slow work.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "pdserve_gguf.json"
TOKENIZER_ONLY = "tokenizer"  # the "dtype" of a directory without weights (the router's)
# Quantization suffixes of GGUF file names: -Q4_K_M, .Q4_1, -IQ3_XS, -f16, -bf16, -mxfp4 ...
_QUANT_SUFFIX = re.compile(r"[._-](?:[IT]?Q\d\w*|B?F(?:16|32)|MXFP4|NVFP4)$", re.IGNORECASE)


class UnsupportedGGUF(ValueError):
    """A GGUF file pdserve cannot convert; the message names what and why."""


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    architecture: str  # general.architecture, as llama.cpp names it
    tensor_types: frozenset[str]  # ggml type names: Q4_1, F32, ...

    @property
    def name(self) -> str:
        return served_name(self.path)


def served_name(path: Path) -> str:
    """The file's name without ``.gguf`` and its quantization suffix: the model's name."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def inspect(path: str | os.PathLike[str]) -> GGUFFile:
    """Read the header (memory-mapped, no weights) and refuse what cannot be converted."""
    import gguf

    p = Path(path)
    try:
        reader = gguf.GGUFReader(p)
        field = reader.fields["general.architecture"]
        arch = str(field.contents())
    except Exception as exc:  # outside input: any parse failure is a refusal
        raise UnsupportedGGUF(f"{p} is not a readable GGUF file ({exc})") from None
    info = GGUFFile(p, arch, frozenset(t.tensor_type.name for t in reader.tensors))
    if not _architecture_supported(arch):
        raise UnsupportedGGUF(
            f"{p.name}: GGUF architecture {arch!r} is not one transformers can read "
            f"(it reads: {', '.join(sorted(supported_architectures()))})"
        )
    bad = sorted(t for t in info.tensor_types if not _dequantizable(t))
    if bad:
        raise UnsupportedGGUF(
            f"{p.name}: GGUF quantization {', '.join(bad)} cannot be dequantized by the "
            f"gguf package (architecture {arch!r})"
        )
    return info


def supported_architectures(*, newer: bool = True) -> set[str]:
    """The GGUF architectures transformers converts: its older loader's table (no torch to
    import) and, with ``newer``, the newer loader's (which imports torch)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    out = set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}
    if newer:
        from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS

        out |= set(GGUF_ARCHS)
    return out


def _architecture_supported(arch: str) -> bool:
    # transformers' own renames: qwen2moe -> qwen2_moe, gpt-oss -> gpt_oss, minimax-m2 ...
    names = {arch, arch.replace("-", "_"), re.sub(r"moe$", "_moe", arch)}
    return bool(names & supported_architectures(newer=False) or names & supported_architectures())


def _dequantizable(type_name: str) -> bool:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    try:  # one zero block: the gguf package raises for the types it cannot unpack
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def file_digest(path: Path, memo_dir: Path) -> str:
    """The file's sha256 (16 hex), memoized by path, size and mtime: big files hash once."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    memo = memo_dir / f"{key[:24]}.sha256"
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    memo_dir.mkdir(parents=True, exist_ok=True)
    memo.write_text(h.hexdigest()[:16])
    return h.hexdigest()[:16]


def converted(root: Path, path: Path, dtype: str) -> Path:
    """Where ``path`` converted to ``dtype`` lives (complete when it holds MARKER). Found
    from the file's name and digest alone: a later start reads no GGUF header."""
    return root / f"{file_digest(path, root / 'digests')}-{dtype}" / served_name(path)


def convert(path: str | os.PathLike[str], dtype: str, root: Path) -> Path:
    """The HF directory of GGUF ``path`` in ``dtype`` (or TOKENIZER_ONLY): cached or built."""
    if dtype not in ("float32", "bfloat16", "float16", TOKENIZER_ONLY):
        raise ValueError(f"dtype must be float32, bfloat16, float16 or {TOKENIZER_ONLY}: {dtype!r}")
    out = converted(root, Path(path), dtype)
    if (out / MARKER).is_file():
        return out
    info = inspect(path)
    out.parent.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent.parent))
    try:
        _write(info, dtype, tmp / out.name)
        try:
            os.replace(tmp, out.parent)
        except OSError:  # a concurrent converter finished first: its bytes equal ours
            if not (out / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(info: GGUFFile, dtype: str, out: Path) -> None:
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    src, name = str(info.path.parent), info.path.name
    steps = ["tokenizer"] + ([] if dtype == TOKENIZER_ONLY else ["dequantize", "write"])
    with tqdm(total=len(steps), desc=f"pdserve: converting {name} ({dtype})", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        config.save_pretrained(out)
        bar.update()
        if dtype != TOKENIZER_ONLY:
            _write_weights(info, dtype, config, out, bar)
    meta = {
        "source": str(info.path.resolve()),
        "architecture": info.architecture,
        "tensor_types": sorted(info.tensor_types),
        "dtype": dtype,
    }
    (out / MARKER).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _write_weights(info: GGUFFile, dtype: str, config, out: Path, bar) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    from pdserve.engine import model_support

    model_support.check_config(config)  # a family the engine refuses: say so before the slow part
    bar.set_postfix_str("dequantize")
    name = info.path.name
    # config: the one already read from this file (each read of a GGUF's metadata parses
    # its whole vocabulary, ~4 s for SmolLM2's 49k tokens)
    model = AutoModelForCausalLM.from_pretrained(
        str(info.path.parent),
        gguf_file=name,
        dtype=getattr(torch, dtype),
        config=config,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    bar.update()
    bar.set_postfix_str("write")
    model.save_pretrained(out)
    bar.update()
