"""The compiled forward: ``torch.compile`` of the model with its paged attention opaque.

Each step runs the model over one flattened sequence of T tokens (decodes and prefill
chunks), so T and the number of sampled rows change every step. The model is compiled
once with dynamic shapes (inductor: C++/OpenMP on CPU, Triton on CUDA) rather than per
padded batch size: one symbolic graph covers every T, and only sizes 0/1 are
specialised, which gives the three variants the warm-up compiles at start-up —
decode of one request (T = 1), decodes of several (T ≥ 2, several rows sampled), and a
prompt chunk (T ≥ 2, one row). Attention is the ``pdserve::paged_attention`` operator
(see attention.py): the compiler fuses norms, rotary embeddings, activations and
residual adds around it and leaves the pool alone.

After the warm-up, a process that compiled one model evaluates only the guards that
told its variants apart (``skip_guard_eval_unsafe``): dynamo otherwise re-checks every
parameter of the model before each step, measured 1.1-2.2 ms of a 4-6 ms decode step of
the tiny preset (16 rows). Safe here because the warm-up ran every variant (so the size
guards that select one have failed once and stay checked), and nothing else a full guard
check would catch (weights, dtypes, the module) changes while a worker serves. A second
compiled model in the process (tests) turns full checks back on.

Inductor's caches live in ``~/.cache/pdserve/inductor`` (``PDSERVE_COMPILE_CACHE``), so
a restarted worker skips code generation (seconds instead of a minute or more); their C++
keys do not hold the venv's path (compile_key.py), so neither does a new checkout. A
shared (sealed) cache is used through a private copy of its checked bytes, and what a
worker compiles is published back to it once it serves (sealed_copy.py).
``--enforce-eager`` (``PDSERVE_ENFORCE_EAGER=1``) runs the model's own eager forward.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve import env
from pdserve.engine import cache_seal, compile_key, cpu_linear, sealed_copy
from pdserve.engine.host_tag import host_tag

logger = logging.getLogger(__name__)

# (label, prompts, max_tokens): the three graph variants, one warm-up generation each.
WARM_UP = (
    ("prompt chunk, one row sampled", [[7] * 24], 1),
    ("one decode", [[7] * 8], 3),
    ("batched decodes and chunks", [[7] * 8, [9] * 40, [11] * 3], 3),
)


def cache_dir() -> Path:
    """Where inductor keeps compiled graphs (set by pdserve.engine at import; a private
    copy of it once ``prepare`` made one, sealed_copy.py)."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or env.get(env.COMPILE_CACHE))


# This process's private copies of a sealed shared cache: copy -> (shared folder, the
# seals of what was copied in), for ``in_service`` to publish what was compiled.
_copies: dict[Path, tuple[Path, dict[str, str]]] = {}


def _use_checked_copy() -> None:
    """Inductor reads a sealed shared cache only through a private copy of the checked
    bytes (sealed_copy.py: a file swapped after the check is never loaded), and keeps its
    precompiled headers in the cache folder in use, never in /tmp/torchinductor_<user>."""
    here = cache_dir()
    ring = cache_seal.ring(env.COMPILE_CACHE)
    if ring:
        if here in _copies:
            shared = _copies[here][0]
        elif here.name.startswith(sealed_copy.PREFIX):  # another process's copy (inherited)
            shared = Path(env.get(env.COMPILE_CACHE)) / host_tag()
        else:
            shared = here
        private = sealed_copy.private_dir()
        _copies[private] = (shared, sealed_copy.copy_checked(shared, private, ring))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(private)
        # Triton's cubins (CUDA): inductor sets TRITON_CACHE_DIR under its cache folder once;
        # one still naming the shared folder would load them from there by path.
        if os.environ.get("TRITON_CACHE_DIR", "").startswith(str(shared)):
            del os.environ["TRITON_CACHE_DIR"]
        from torch._inductor import codecache

        codecache.CacheBase.get_local_cache_path.cache_clear()  # keyed on the old folder
    sealed_copy.install_headers()


_models_compiled = 0  # in this process; guard checks are trimmed only while it is 1
_serving = False  # in_service() was called: the warm-up compiled every variant


def prepare(model: torch.nn.Module) -> None:
    """What the compiled forward needs done to the model first, on the thread that serves
    it (it swaps the linear layers): oneDNN-packed or input-major weights, the cache's seal
    checked. The eager forward runs these layers too until the compiled one is swapped in."""
    global _models_compiled
    _models_compiled += 1
    if _models_compiled > 1:  # one code object caches every model's graphs: check all
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)
    # ... and counts them against one recompile limit (8 by default), past which dynamo
    # silently runs eager: leave room for every model's variants.
    dynamo_config = torch._dynamo.config
    need = len(WARM_UP) * _models_compiled + 2
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, need)
    cpu_linear.prepare(model)  # oneDNN-packed or input-major weights
    compile_key.install()  # C++ cache keys without the venv's path: a new checkout reuses them
    # Nothing from a shared cache is loaded unless this service sealed it (cache_seal.py),
    # and only as the bytes that were checked (sealed_copy.py).
    _use_checked_copy()


def compiled_forward(model: torch.nn.Module) -> Callable[..., Any]:
    """The prepared model's forward, compiled with dynamic shapes (lazily: the first call
    of each variant traces and compiles it, or loads it from the cache on disk)."""
    # A C++ wrapper calls the step's ~40 kernels instead of generated Python: measured
    # 0.4-2 ms less per 4-8 ms decode step of the tiny preset (a slower first compile).
    compiled = torch.compile(model, dynamic=True, options={"cpp_wrapper": True})
    return compiled  # type: ignore[return-value]


def compile_model(model: torch.nn.Module) -> Callable[..., Any]:
    """The model's forward, compiled with dynamic shapes; caches on disk."""
    prepare(model)
    return compiled_forward(model)


def in_service() -> None:
    """The compiled forward serves from now on (every variant compiled): trim the guard
    checks (module docstring) and seal the cache this process wrote."""
    global _serving
    _serving = True
    if _models_compiled == 1:
        torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    here, ring = cache_dir(), cache_seal.ring(env.COMPILE_CACHE)
    if here in _copies:  # what this process compiled goes to the shared cache, sealed
        shared, copied = _copies[here]
        sealed_copy.publish(here, shared, ring, copied)
    else:
        cache_seal.seal(here, ring)


def serving() -> bool:
    """Whether a compiled forward of this process is in service (``in_service``): from
    then on a runner calls its proven graph variants directly (graph_call.py)."""
    return _serving


def say(line: str) -> None:
    """A start-up progress line on stderr (a worker's log; ``pdserve up`` shows a summary)."""
    print(line, file=sys.stderr, flush=True)
