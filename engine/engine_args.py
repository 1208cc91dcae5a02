"""The engine's flags: the fields of :class:`EngineArgs` (pdserve/config_cli.py).

Every command that runs an engine (the workers, ``pdserve generate``, ``pdserve profile``)
takes them; ``engine_config_from_args`` (below) turns them into an
:class:`~pdserve.engine.config.EngineConfig`. Importing this module loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config_cli import add_flags, checked, flag_group
from pdserve.engine.config import DTYPES, EngineConfig
from pdserve.engine.kv_tiers.config import TierArgs, tier_config_from_args
from pdserve.engine.lora_files import LoraConfig, parse_lora_flag
from pdserve.engine.model_source import resolve_model
from pdserve.engine.spec_config import parse_speculative

flag_engine = flag_group("engine")
flag_lora = flag_group("LoRA adapters (docs/lora.md)")


# --lora's and --speculative's checks at parse time (engine/lora_files.py,
# engine/spec_config.py): argparse names the flag in its error.
lora_flag = checked(parse_lora_flag, keep_text=True)
speculative_flag = checked(parse_speculative, keep_text=True)


@dataclass(frozen=True)
class EngineArgs:
    """The model, its memory and its batch."""

    model: str = flag_engine(
        help="HF-format model directory, FILE.gguf (converted once, cached) or "
        "'tiny' (the random test model)",
        short=True,
        required=True,
    )
    dtype: str = flag_engine(
        "auto",
        "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
        short=True,
        choices=("auto", *DTYPES),
    )
    device: str = flag_engine("auto", "auto | cpu | cuda | cuda:N", short=True)
    served_model_name: str | None = flag_engine(
        None, "the model's name in replies (default: the directory's)", short=True
    )
    block_size: int = flag_engine(16, "tokens per KV block (a power of two)")
    kv_cache_bytes: int | None = flag_engine(
        None, "the KV pool's size; wins over --kv-cache-fraction"
    )
    kv_cache_fraction: float | None = flag_engine(
        None,
        "share of free memory for the KV pool (default: the device's own)",
        short=True,
    )
    max_num_seqs: int = flag_engine(128, "running requests at most", short=True)
    max_num_batched_tokens: int = flag_engine(2048, "token budget of one step")
    max_model_len: int | None = flag_engine(
        None,
        "longest prompt + output (default: the model's max_position_embeddings)",
        short=True,
    )
    no_prefix_caching: bool = flag_engine(False, "turn the prefix cache off")
    cpu_threads: int | None = flag_engine(
        None,
        "torch threads for CPU compute (default: torch's, all "
        "cores); give each worker on a shared machine its share",
    )
    grammar_cache_bytes: int = flag_engine(
        64 << 20, "memory for compiled structured-output grammars (LRU beyond)"
    )
    grammar_compile_timeout: float = flag_engine(
        10.0, "seconds a grammar may take to compile; a slower one is a 400"
    )
    speculative: str | None = flag_engine(
        None,
        "speculative decoding: ngram:k=4 (prompt lookup, up to k drafts a step; also "
        "min_n=, max_n=; docs/speculative.md) or draft:model=PATH,k=N (a draft model "
        "sharing the target's tokenizer)",
        metavar="SPEC",
        parse=speculative_flag,
    )
    enforce_eager: bool = flag_engine(
        False,
        "run the model's eager forward: no torch.compile at start-up",
        short=True,
        env=env.ENFORCE_EAGER,
    )
    compile_before_ready: bool = flag_engine(
        False,
        "compile the forward before reporting ready (the default serves the eager forward "
        "at once and swaps to the compiled one once it is compiled and checked: "
        "docs/workers.md, Start-up)",
    )
    lora: tuple[str, ...] = flag_lora(
        (),
        "a PEFT LoRA adapter directory served as NAME (repeatable; "
        "more at run time through /v1/load_lora_adapter); a worker "
        "with adapters runs the eager forward",
        metavar="NAME=PATH",
        parse=lora_flag,
        many="append",
    )
    max_loras: int = flag_lora(4, "LoRA adapters resident at once (one step mixes them)")
    max_cpu_loras: int = flag_lora(8, "LoRA adapters kept in host memory (least recently used out)")
    max_lora_rank: int = flag_lora(64, "largest LoRA rank accepted")
    lora_root: tuple[str, ...] = flag_lora(
        (),
        "a directory run-time loads (/v1/load_lora_adapter) may read adapters from, "
        "resolved, no escapes (repeatable; default: the folders holding the --lora "
        "adapters, else none: no run-time loads)",
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
