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

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pdserve import keys

log = logging.getLogger(__name__)

MANIFEST = ".pdserve-seal.json"
MODEL_SEAL = ".pdserve-model-seal-"  # engine/model_seal.py's manifests
_SKIP_SUFFIXES = (".lock",)  # lock files carry no code; inductor recreates them


def ring(location_env: str) -> keys.KeyRing:
    """The compile-cache keys when sealing applies to the cache named by ``location_env``
    (empty: sealing is off)."""
    if not os.environ.get(location_env):
        return keys.KeyRing(keys.COMPILE_CACHE, ())
    return keys.KeyRing.from_env(keys.COMPILE_CACHE)


def _open(path: Path) -> int:
    """``path`` opened read-only without following a symlink at its last component; the
    opened file must be a regular file (OSError otherwise, the fd closed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def fd_tag(key: bytes, rel: str, fd: int) -> bytes:
    """The seal of the open file ``fd`` (read from its start) at relative path ``rel``."""
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
        digest.update(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return keys.mac(key, rel.encode(), digest.digest())


def file_tag(key: bytes, folder: Path, path: Path) -> bytes:
    fd = _open(path)
    try:
        return fd_tag(key, path.relative_to(folder).as_posix(), fd)
    finally:
        os.close(fd)


def _scan(folder: Path) -> tuple[list[Path], list[Path]]:
    """(regular files to check, entries never to trust): every symlink (to a file or to a
    directory: os.walk lists a linked directory but never enters it, while inductor would
    follow it) and everything that is neither a file nor a directory, found by lstat."""
    files, bad = [], []
    for root, dirs, names in os.walk(folder):
        for name in [*dirs, *names]:
            path = Path(root) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                bad.append(path)
            elif stat.S_ISREG(mode) and not _own(name):
                files.append(path)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
    return files, bad


def _own(name: str) -> bool:
    """The seals themselves (this folder's manifest, the model's: engine/model_seal.py,
    HMAC'd on their own) and lock files: never sealed, never removed."""
    return name == MANIFEST or name.startswith(MODEL_SEAL) or name.endswith(_SKIP_SUFFIXES)


@contextlib.contextmanager
def manifest_lock(folder: Path) -> Iterator[None]:
    """Held while a manifest is read, changed and replaced: two processes sealing or
    publishing at once each keep the other's entries (without it, the later rename drops
    what the earlier one added, and those files go unsealed: recompiled, never loaded).
    The lock file is one of the folder's own (``.lock``: never sealed), opened with
    O_NOFOLLOW (a planted link is an OSError, not a file created elsewhere)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(folder / (MANIFEST + ".lock"), flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _files(folder: Path) -> list[Path]:
    return _scan(folder)[0]


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
    files, bad = _scan(folder)
    for path in bad:  # the link itself goes, never what it points at
        path.unlink(missing_ok=True)
        removed.append(path.relative_to(folder).as_posix())
    for path in files:
        rel = path.relative_to(folder).as_posix()
        try:
            ok = _valid(ring_, folder, path, sealed.get(rel))
        except OSError:  # swapped for a link or a fifo since the scan
            ok = False
        if not ok:
            path.unlink(missing_ok=True)
            removed.append(rel)
    if removed:
        log.warning(
            "compile cache %s: removed %d file(s) without this service's seal "
            "(first: %s); they are compiled again",
            folder,
            len(removed),
            removed[0],
        )
    return removed


def seal(folder: Path, ring_: keys.KeyRing) -> int:
    """Seal every file of ``folder`` under the signing key (those already sealed by any
    of the ring's keys keep their seal); returns how many files carry a seal."""
    if not ring_ or not folder.is_dir():
        return 0
    with manifest_lock(folder):
        return _seal_locked(folder, ring_)


def _seal_locked(folder: Path, ring_: keys.KeyRing) -> int:
    old, new = _manifest(folder), {}
    for path in _files(folder):
        rel = path.relative_to(folder).as_posix()
        try:
            if rel in old and _valid(ring_, folder, path, old[rel]):
                new[rel] = old[rel]
            else:
                new[rel] = file_tag(ring_.signing, folder, path).hex()
        except OSError:  # replaced by a link or removed since the scan: never sealed
            continue
    write_manifest(folder, new)
    return len(new)


def write_manifest(folder: Path, seals: dict[str, str]) -> None:
    """``folder``'s manifest replaced whole by ``seals`` (readers see the old or the new);
    the caller holds ``manifest_lock``."""
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".seal")
    with os.fdopen(fd, "w") as f:
        json.dump(seals, f)
    os.replace(tmp, folder / MANIFEST)


def open_sealed(folder: Path, path: Path, ring_: keys.KeyRing) -> int:
    """An fd of ``path`` whose content carries this service's seal (any file when sealing
    is off), opened with O_NOFOLLOW and checked as opened: load from ``/proc/self/fd/N``
    and what was checked is what runs, whatever replaces ``path`` meanwhile. OSError
    when the path is a symlink, not a regular file, or unsealed."""
    fd = _open(path)
    if not ring_:
        return fd
    rel = path.relative_to(folder).as_posix()
    tag_hex = _manifest(folder).get(rel, "")
    try:
        want = bytes.fromhex(tag_hex)
        if tag_hex and any(fd_tag(k, rel, fd) == want for k in ring_.keys):
            return fd
    except ValueError:
        pass
    os.close(fd)
    raise OSError(f"{path} does not carry this service's seal")


def read_sealed(folder: Path, path: Path, ring_: keys.KeyRing) -> bytes:
    """The content of ``path``, read once from an O_NOFOLLOW fd of a regular file, and
    checked: the bytes returned are the bytes whose seal was verified (any content when
    sealing is off). OSError when the path is a symlink, not a regular file, or unsealed."""
    fd = _open(path)
    try:
        chunks = list(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if not ring_:
        return data
    rel = path.relative_to(folder).as_posix()
    try:
        want = bytes.fromhex(_manifest(folder).get(rel, ""))
    except ValueError:
        want = b""
    digest = hashlib.sha256(data).digest()
    if want and any(keys.mac(k, rel.encode(), digest) == want for k in ring_.keys):
        return data
    raise OSError(f"{path} does not carry this service's seal")
