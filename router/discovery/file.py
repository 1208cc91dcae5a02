"""Worker discovery from a JSON file that the router re-reads: local mode with autoscaling.

``pdserve up --autoscale`` adds and removes worker processes while the router
runs; it rewrites the file (atomically: write a temp file, rename) and the
router picks the change up on its next health round. Format::

    {"prefill": ["http://127.0.0.1:8100"], "decode": ["http://127.0.0.1:8200"]}
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from pdserve.router.discovery.workers import Endpoint, EndpointSource, normalize_url
from pdserve.router.file_watch import WatchedFile

log = logging.getLogger(__name__)


def read_workers_file(path: str | Path) -> list[Endpoint]:
    """Parse the file; raises ValueError naming the file and the problem."""
    try:
        body: Any = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"workers file {path}: {exc}") from exc
    if not isinstance(body, dict) or set(body) - {"prefill", "decode"}:
        raise ValueError(f'workers file {path}: expected {{"prefill": [...], "decode": [...]}}')
    out = []
    for role in ("prefill", "decode"):
        urls = body.get(role, [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"workers file {path}: {role!r} must be a list of URLs")
        out += [Endpoint(normalize_url(u), role) for u in urls]
    return out


def write_workers_file(path: str | Path, prefill: list[str], decode: list[str]) -> None:
    """Replace the file atomically, so the router never reads half of it. The temporary
    file is the writer thread's own: two writers at once never rename each other's."""
    tmp = Path(f"{path}.{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"prefill": prefill, "decode": decode}) + "\n")
    os.replace(tmp, path)


class FileSource(EndpointSource):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = WatchedFile(path, read_workers_file)
        endpoints = self._file.changed()  # a bad file fails at start-up
        assert endpoints is not None  # the first check always reads
        self._endpoints = endpoints

    async def list(self) -> list[Endpoint]:
        endpoints = self._file.changed()  # on error: Discovery keeps the old
        if endpoints is not None:
            self._endpoints = endpoints
            log.info("workers file changed: %d workers", len(endpoints))
        return list(self._endpoints)
