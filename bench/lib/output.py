"""A bench's result: one JSON line on stdout, optionally also written to a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(record: dict[str, Any], path: str | Path | None = None) -> str:
    """Print ``record`` as one sorted-key JSON line (what the tests and the recordings read)
    and, with ``path``, write it there too. Returns the line."""
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(line + "\n")
    return line
