"""Compiled code in a shared cache is loaded only if this service sealed it.

A worker's compiled code (inductor's graphs and kernels, the attention kernel) is native
code the worker loads and runs. Where the cache lives on a volume others can write (the
shared model cache: one PVC mounted by several services), a file planted there would
run inside this service's workers, with its weights, its KV and its secret. So every
file is sealed: an HMAC, under a key derived from the service secret (pdserve/keys.py,
``compile-cache``), over its path and content. Before a worker compiles (and so before
inductor or ctypes loads anything from the cache) the folder is checked and every file
without a valid seal is deleted: the worker then compiles it again and seals its own.
The operator also gives each service its own folder (a subPath), so services never
meet; the seal is what holds when the folder is reachable anyway.

Active where the cache location is set explicitly (``PDSERVE_COMPILE_CACHE``,
``PDSERVE_KERNEL_CACHE``: the operator sets them for a shared cache) and a service
secret exists; a private cache under ``~/.cache`` is left alone (``pdserve up`` draws a
new secret per run and would throw its cache away each time).

Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from pdserve import keys

log = logging.getLogger(__name__)

MANIFEST = ".pdserve-seal.json"
_SKIP_SUFFIXES = (".lock",)  # lock files carry no code; inductor recreates them


def ring(location_env: str) -> keys.KeyRing:
    """The compile-cache keys when sealing applies to the cache named by ``location_env``
    (empty: sealing is off)."""
    if not os.environ.get(location_env):
        return keys.KeyRing(keys.COMPILE_CACHE, ())
    return keys.KeyRing.from_env(keys.COMPILE_CACHE)


def file_tag(key: bytes, folder: Path, path: Path) -> bytes:
    rel = path.relative_to(folder).as_posix().encode()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return keys.mac(key, rel, digest.digest())


def _files(folder: Path) -> list[Path]:
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            if name != MANIFEST and not name.endswith(_SKIP_SUFFIXES) and path.is_file():
                out.append(path)
    return out


def _manifest(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _valid(ring_: keys.KeyRing, folder: Path, path: Path, tag_hex: str | None) -> bool:
    if tag_hex is None:
        return False
    try:
        tag = bytes.fromhex(tag_hex)
    except ValueError:
        return False
    return any(file_tag(k, folder, path) == tag for k in ring_.keys)


def verify(folder: Path, ring_: keys.KeyRing) -> list[str]:
    """Delete every file of ``folder`` without a valid seal; returns their relative paths."""
    if not ring_ or not folder.is_dir():
        return []
    sealed, removed = _manifest(folder), []
    for path in _files(folder):
        rel = path.relative_to(folder).as_posix()
        if not _valid(ring_, folder, path, sealed.get(rel)):
            path.unlink(missing_ok=True)
            removed.append(rel)
    if removed:
        log.warning("compile cache %s: removed %d file(s) without this service's seal "
                    "(first: %s); they are compiled again",
                    folder, len(removed), removed[0])  # fmt: skip
    return removed


def seal(folder: Path, ring_: keys.KeyRing) -> int:
    """Seal every file of ``folder`` under the signing key (those already sealed by any
    of the ring's keys keep their seal); returns how many files carry a seal."""
    if not ring_ or not folder.is_dir():
        return 0
    old, new = _manifest(folder), {}
    for path in _files(folder):
        rel = path.relative_to(folder).as_posix()
        if rel in old and _valid(ring_, folder, path, old[rel]):
            new[rel] = old[rel]
        else:
            new[rel] = file_tag(ring_.signing, folder, path).hex()
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".seal")
    with os.fdopen(fd, "w") as f:
        json.dump(new, f)
    os.replace(tmp, folder / MANIFEST)  # readers see the old manifest or the new, whole
    return len(new)
