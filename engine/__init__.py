"""The engine: paged KV, continuous batching, the model runner and sampling."""

import os as _os
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
