"""A PEFT LoRA adapter on disk: its identity (``adapter_hash``) and its checked config.

Imports no torch: the router hashes adapters too (the hash seeds the block-hash chain,
pdserve/protocol/hashing.py). An adapter is a directory with ``adapter_config.json`` and
``adapter_model.safetensors``, as PEFT's ``save_pretrained`` writes it. What the engine
does not implement is refused by name at load, never served approximately: DoRA, bias
terms, ``modules_to_save``, per-module rank or alpha patterns, layer subsets and
replication, embedding / lm_head targets, and any other PEFT type than LORA.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections a LoRA may target (Llama-style names; a model without one refuses it).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_CONFIG_BYTES = 1 << 20
# Options that change the math; a set value is refused under the option's own name.
REFUSED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias terms (lora_bias)",
    "modules_to_save": "modules_to_save (full copies of modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layers_to_transform": "layer subsets (layers_to_transform)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "parameter targets (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts)",
    "use_qalora": "QA-LoRA (use_qalora)",
}
REFUSED_TARGETS = ("embed_tokens", "lm_head", "embed", "wte", "wpe")


class LoraError(ValueError):
    """An adapter that cannot be served; ``field`` names what is wrong (for a 400)."""

    def __init__(self, message: str, field: str = "lora_path") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class LoraConfig:
    max_loras: int = 4  # device slots
    max_cpu_loras: int = 8  # adapters kept in host memory
    max_lora_rank: int = 64
    loras: tuple[tuple[str, str], ...] = ()  # (name, path) known at start (--lora)
    # Directories a run-time load (/v1/load_lora_adapter) may read an adapter from
    # (--lora-root; none given: the folders that hold the --lora adapters, else none).
    roots: tuple[str, ...] = ()

    def load_roots(self) -> tuple[str, ...]:
        if self.roots:
            return self.roots
        return tuple(sorted({os.path.dirname(os.path.abspath(p)) for _, p in self.loras}))

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be positive")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                f"--max-loras ({self.max_loras})"
            )


def parse_lora_flag(value: str) -> tuple[str, str]:
    """``--lora NAME=PATH`` → (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora {value!r}: expected NAME=PATH")
    return name, path


@dataclass(frozen=True)
class LoraSpec:
    """A checked adapter directory: what the registry loads."""

    name: str
    path: str
    hash: str  # adapter_hash(path)
    rank: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with use_rslora


def adapter_hash(path: str | Path) -> str:
    """Hex blake2b-128 of the adapter's files' bytes: adapter_config.json, then the weights."""
    root = Path(path)
    h = hashlib.blake2b(digest_size=16, person=b"pdserve-lora")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(root / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


NOT_AN_ADAPTER = (
    f"lora_path is not an adapter directory ({CONFIG_FILE} and {WEIGHTS_FILE}) "
    "under the workers' --lora-root"
)


def allowed_path(path: str, roots: tuple[str, ...]) -> str:
    """``path`` resolved (symlinks and ``..`` followed) when it lies under one of
    ``roots``; LoraError otherwise, the same message whether or not the path exists."""
    resolved = os.path.realpath(path)
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([resolved, real_root]) == real_root and resolved != real_root:
            return resolved
    raise LoraError(NOT_AN_ADAPTER)


def read_spec(name: str, path: str | Path, max_rank: int) -> LoraSpec:
    """Check the adapter directory at ``path``; LoraError naming the problem (one message
    for every missing or unreadable path: the error does not tell which paths exist)."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(NOT_AN_ADAPTER)
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / required).is_file():
            raise LoraError(NOT_AN_ADAPTER)
    config = _read_config(name, root / CONFIG_FILE)
    rank, scaling = check_config(name, config, max_rank)
    return LoraSpec(name, str(root), adapter_hash(root), rank, scaling)


def _read_config(name: str, file: Path) -> dict[str, Any]:
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return config


def check_config(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config; LoraError for what is not implemented."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"adapter {name!r}: peft_type {peft_type!r} is not supported (LORA)")
    for key, what in REFUSED_OPTIONS.items():
        if config.get(key):
            raise LoraError(f"adapter {name!r}: {what} is not supported")
    bias = config.get("bias", "none")
    if bias != "none":
        raise LoraError(f"adapter {name!r}: bias={bias!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank {rank} is over --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules") or []
    listed = [targets] if isinstance(targets, str) else list(targets)
    for target in listed:
        if any(str(target).split(".")[-1] == bad for bad in REFUSED_TARGETS):
            raise LoraError(
                f"adapter {name!r}: target {target!r} is not supported "
                f"(only {', '.join(PROJECTIONS)})"
            )
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / root
