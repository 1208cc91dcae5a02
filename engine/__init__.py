"""The engine: paged KV, continuous batching, the model runner and sampling."""

import os as _os
from pathlib import Path as _Path

# torch.compile's generated code goes to pdserve's own cache (see compiled.py), set before
# anything asks inductor for its cache directory: inductor fixes the location on first
# use, and its default (/tmp/torchinductor_<user>) is shared with every other torch on
# the machine, whose headers and graphs do not fit this one.
_os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    _os.environ.get("PDSERVE_COMPILE_CACHE")
    or str(_Path.home() / ".cache" / "pdserve" / "inductor"),
)
