"""Engine configuration: one frozen dataclass, derived values as properties.

Importing this module loads no torch: a worker's front end parses the engine flags and
builds the config, and only the engine process, which asks for ``torch_device`` /
``torch_dtype``, imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.kv_tiers.config import TierConfig
from pdserve.engine.lora_files import LoraConfig
from pdserve.engine.spec_config import parse_speculative

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local HF-format directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16
    kv_cache_bytes: int | None = None  # explicit KV pool budget; wins over the fraction
    kv_cache_fraction: float | None = None  # share of free memory for the KV pool
    max_num_seqs: int = 128  # running requests at most
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    cpu_threads: int | None = None  # torch intra-op threads (CPU); None: torch's default
    compile: bool = False  # torch.compile the forward (workers: on unless --enforce-eager)
    compile_in_background: bool = False  # serve eager until compiled (workers: on)
    grammar_cache_bytes: int = 64 << 20  # compiled grammars kept (engine/structured.py)
    grammar_compile_timeout_s: float = 10.0  # a slower grammar is refused (worker/core/loop.py)
    lora: LoraConfig | None = None  # multi-LoRA (engine/lora_registry.py); None: off
    kv_tiers: TierConfig | None = None  # KV tiers below the pool (docs/kv_tiers.md); None: off
    # Speculative decoding: "ngram:k=4" (engine/spec_config.py); None: off.
    speculative: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        parse_speculative(self.speculative)  # a ValueError naming the field

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            # bfloat16 where the hardware does it fast; float32 on CPU for exactness.
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    @property
    def dtype_name(self) -> str:
        return str(self.torch_dtype).removeprefix("torch.")
