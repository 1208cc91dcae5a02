"""Inductor's C++ cache keys without the venv's path: a new checkout reuses the kernels.

Inductor keys each C++ file it builds by its source and the compiler's command line
(``codecache.write(..., extra=command line)``), and that line names torch's include and
library folders inside the venv (``-I<venv>/.../torch/include``, ``-L<venv>/.../torch/lib``).
So every checkout's venv built every compiled family's kernels again (~22 families,
~15 CPU-min on this machine) though the code, the flags and torch were the same.

``install()`` wraps ``codecache.write`` so that, in the key only, torch's folder is
replaced by what decides the headers and libraries found there (torch's version and
``torch_key()``, the hash of torch's sources inductor keys its graphs with), and the
compiler's version is added (inductor's own line names only ``g++``). The key still
changes with torch, with the compiler, with every flag and with any other path on the
line (the Python headers'); the command that runs still names the real folders. The
built library needs nothing from the old path: it is linked by name (``-ltorch``, no
rpath) against the libraries this process has loaded.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

_installed = False


def _torch_roots() -> tuple[str, ...]:
    """Torch's folder as the command line spells it, and resolved (a symlinked venv)."""
    from torch.utils import cpp_extension

    spelled = os.path.dirname(cpp_extension.TORCH_LIB_PATH)
    return tuple(dict.fromkeys([spelled, os.path.realpath(spelled)]))


def torch_token() -> str:
    """What a command line's torch folder stands for in a key."""
    import torch
    from torch._inductor.codecache import torch_key

    return f"<torch {torch.__version__} {torch_key().hex()[:32]}>"


def compiler_token() -> str:
    """The version of the C++ compiler inductor runs (``g++ -v``: cached per process)."""
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

    return f"<cxx {get_compiler_version_info(get_cpp_compiler())}>"


def stable_extra(extra: str) -> str:
    """``extra`` (a key's extra text holding a command line) with torch's folder replaced
    by ``torch_token()`` and the compiler's version appended; unchanged (the same key as
    inductor's own) when it names no torch folder."""
    roots = [r for r in _torch_roots() if r in extra]
    if not roots:
        return extra
    pattern = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))
    stable = re.sub(f"(?:{pattern})(?=[/\\s'\"]|$)", torch_token(), extra)
    return stable + compiler_token()


def install() -> None:
    """Route inductor's key computation through ``stable_extra`` (once per process)."""
    global _installed
    if _installed:
        return
    from torch._inductor import codecache

    original = codecache.write

    @functools.wraps(original)
    def write(content: Any, extension: str, extra: str = "", *args: Any, **kw: Any) -> Any:
        if extra and isinstance(extra, str):
            extra = stable_extra(extra)
        return original(content, extension, extra, *args, **kw)

    codecache.write = write
    _installed = True
