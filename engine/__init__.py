"""The engine: paged KV, continuous batching, the model runner and sampling."""

import os as _os
import sys as _sys
from pathlib import Path as _Path

from pdserve.engine.host_tag import host_tag as _host_tag

# torch.compile's generated code goes to pdserve's own cache (see compiled.py), set before
# anything asks inductor for its cache directory: inductor fixes the location on first
# use, and its default (/tmp/torchinductor_<user>) is shared with every other torch on
# the machine, whose headers and graphs do not fit this one. One folder per kind of CPU
# (host_tag.py): inductor's cache would hand one CPU's kernels to another.
_os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    str(
        _Path(
            _os.environ.get("PDSERVE_COMPILE_CACHE")
            or _Path.home() / ".cache" / "pdserve" / "inductor"
        )
        / _host_tag()
    ),
)

# Inductor checks the CPU's vector ISA in a child Python whose PYTHONPATH is this process's
# sys.path (unless TORCH_CUSTOM_PYTHONPATH names one). Run from a pdserve checkout (a worker
# started in the repository root, pytest), that path holds the repository root, whose
# operator/ shadows the standard library's: the child dies, the ISA reads as absent, and
# inductor generates scalar kernels, or builds a cached vector kernel without the ISA's flags
# (a C++ compile error). Set here, at import, so every process that compiles (a worker, a
# test or bench calling torch.compile itself) hands the child the path without such entries.
_os.environ.setdefault(
    "TORCH_CUSTOM_PYTHONPATH",
    _os.pathsep.join(p for p in _sys.path if not (_Path(p or ".") / "operator").is_dir()),
)
