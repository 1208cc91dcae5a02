"""The engine's flags: the fields of :class:`EngineArgs` (pdserve/config_cli.py).

Every command that runs an engine (the workers, ``pdserve generate``, ``pdserve profile``)
takes them; ``engine_config_from_args`` (below) turns them into an
:class:`~pdserve.engine.config.EngineConfig`. Importing this module loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config_cli import add_flags, checked, flag
from pdserve.engine.config import DTYPES, EngineConfig
from pdserve.engine.kv_tiers.config import TierArgs, tier_config_from_args
from pdserve.engine.lora_files import LoraConfig, parse_lora_flag
from pdserve.engine.model_source import resolve_model
from pdserve.engine.spec_config import parse_speculative

ENGINE, LORA = "engine", "LoRA adapters (docs/lora.md)"


# --lora's and --speculative's checks at parse time (engine/lora_files.py,
# engine/spec_config.py): argparse names the flag in its error.
lora_flag = checked(parse_lora_flag, keep_text=True)
speculative_flag = checked(parse_speculative, keep_text=True)


@dataclass(frozen=True)
class EngineArgs:
    """The model, its memory and its batch."""

    model: str = flag(
        help="HF-format model directory, FILE.gguf (converted once, cached) or "
        "'tiny' (the random test model)",
        group=ENGINE,
        short=True,
        required=True,
    )
    dtype: str = flag(
        "auto",
        "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
        group=ENGINE,
        short=True,
        choices=("auto", *DTYPES),
    )
    device: str = flag("auto", "auto | cpu | cuda | cuda:N", group=ENGINE, short=True)
    served_model_name: str | None = flag(
        None, "the model's name in replies (default: the directory's)", group=ENGINE, short=True
    )
    block_size: int = flag(16, "tokens per KV block (a power of two)", group=ENGINE)
    kv_cache_bytes: int | None = flag(
        None, "the KV pool's size; wins over --kv-cache-fraction", group=ENGINE
    )
    kv_cache_fraction: float | None = flag(
        None,
        "share of free memory for the KV pool (default: the device's own)",
        group=ENGINE,
        short=True,
    )
    max_num_seqs: int = flag(128, "running requests at most", group=ENGINE, short=True)
    max_num_batched_tokens: int = flag(2048, "token budget of one step", group=ENGINE)
    max_model_len: int | None = flag(
        None,
        "longest prompt + output (default: the model's max_position_embeddings)",
        group=ENGINE,
        short=True,
    )
    no_prefix_caching: bool = flag(False, "turn the prefix cache off", group=ENGINE)
    cpu_threads: int | None = flag(
        None,
        "torch threads for CPU compute (default: torch's, all "
        "cores); give each worker on a shared machine its share",
        group=ENGINE,
    )
    grammar_cache_bytes: int = flag(
        64 << 20, "memory for compiled structured-output grammars (LRU beyond)", group=ENGINE
    )
    grammar_compile_timeout: float = flag(
        10.0, "seconds a grammar may take to compile; a slower one is a 400", group=ENGINE
    )
    speculative: str | None = flag(
        None,
        "speculative decoding: ngram:k=4 (prompt lookup, up to k drafts a step; also "
        "min_n=, max_n=; docs/speculative.md) or draft:model=PATH,k=N (a draft model "
        "sharing the target's tokenizer)",
        group=ENGINE,
        metavar="SPEC",
        parse=speculative_flag,
    )
    enforce_eager: bool = flag(
        False,
        "run the model's eager forward: no torch.compile at start-up",
        group=ENGINE,
        short=True,
        env=env.ENFORCE_EAGER,
    )
    compile_before_ready: bool = flag(
        False,
        "compile the forward before reporting ready (the default serves the eager forward "
        "at once and swaps to the compiled one once it is compiled and checked: "
        "docs/workers.md, Start-up)",
        group=ENGINE,
    )
    lora: tuple[str, ...] = flag(
        (),
        "a PEFT LoRA adapter directory served as NAME (repeatable; "
        "more at run time through /v1/load_lora_adapter); a worker "
        "with adapters runs the eager forward",
        group=LORA,
        metavar="NAME=PATH",
        parse=lora_flag,
        many="append",
    )
    max_loras: int = flag(4, "LoRA adapters resident at once (one step mixes them)", group=LORA)
    max_cpu_loras: int = flag(
        8, "LoRA adapters kept in host memory (least recently used out)", group=LORA
    )
    max_lora_rank: int = flag(64, "largest LoRA rank accepted", group=LORA)
    lora_root: tuple[str, ...] = flag(
        (),
        "a directory run-time loads (/v1/load_lora_adapter) may read adapters from, "
        "resolved, no escapes (repeatable; default: the folders holding the --lora "
        "adapters, else none: no run-time loads)",
        group=LORA,
        metavar="DIR",
        many="append",
    )


def add_engine_arguments(parser) -> None:  # type: ignore[no-untyped-def]
    """The engine flags shared by every command that runs an engine: the fields of
    EngineArgs and TierArgs."""
    add_flags(parser, (EngineArgs, TierArgs))


# The flags that are the EngineConfig field of the same name, taken as given.
_AS_GIVEN = (
    "dtype",
    "device",
    "block_size",
    "kv_cache_bytes",
    "kv_cache_fraction",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "served_model_name",
    "cpu_threads",
)


def engine_config_from_args(
    args: Any, *, resolve: bool = True, background: bool = False
) -> EngineConfig:
    """The config of an engine process; a GGUF ``--model`` becomes its converted directory
    (engine/model_source.py), in the dtype this engine will run in. ``resolve=False``
    keeps ``--model`` as given (a worker's front end: its core resolves it)."""
    loras = tuple(parse_lora_flag(v) for v in getattr(args, "lora", None) or ())
    return EngineConfig(
        model=resolve_model(args.model, args.dtype, args.device) if resolve else args.model,
        **{name: getattr(args, name) for name in _AS_GIVEN},
        enable_prefix_caching=not args.no_prefix_caching,
        # Adapter layers run eager (docs/lora.md): no compile for a worker that has some.
        compile=not (args.enforce_eager or env.eager_forced() or loras),
        # a worker's (``background``): serve eager, compile in the background (compile_job.py)
        compile_in_background=background and not getattr(args, "compile_before_ready", False),
        grammar_cache_bytes=getattr(args, "grammar_cache_bytes", 64 << 20),
        grammar_compile_timeout_s=getattr(args, "grammar_compile_timeout", 10.0),
        speculative=getattr(args, "speculative", None),
        lora=LoraConfig(
            max_loras=getattr(args, "max_loras", 4),
            max_cpu_loras=getattr(args, "max_cpu_loras", 8),
            max_lora_rank=getattr(args, "max_lora_rank", 64),
            loras=loras,
            roots=tuple(getattr(args, "lora_root", None) or ()),
        ),
        kv_tiers=tier_config_from_args(args),
    )
