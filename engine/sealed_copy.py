"""A shared compile cache is used through a private copy of the bytes that were checked.

``cache_seal.verify`` checks every file's seal, but inductor opens its entries by path
later, at the first call of each graph variant (a pickled FX graph or AOTAutograd entry,
a generated ``.py`` it imports, a ``.so`` it loads): a file swapped or rewritten in the
shared folder after the check was loaded unchecked. So where sealing is on, the worker
copies the sealed entries into a folder of its own and points inductor there
(``TORCHINDUCTOR_CACHE_DIR``): each file opened with ``O_NOFOLLOW`` under directory fds
(``os.fwalk``), checked as a regular file with ``fstat``, read once, its seal verified on
those bytes, and those bytes written to the copy. What is unsealed, tampered with or a
link is removed from the shared folder (as ``verify`` does) and compiled again.

What the worker compiles lands in its copy and is published back once it serves
(``publish``): each new file written to the shared folder under a temporary name and
renamed (directories opened with ``O_NOFOLLOW``: a planted link is never written
through), its seal the tag of the bytes this process wrote, never of what the shared
folder holds by then. The next worker copies and reuses it.

The private folder: ``mkdtemp`` (mode 0700, owned by this process, a random name) under
the system's temporary folder, which must be a real folder owned by root or by us and,
where others may write it, sticky (nobody else may rename or remove our folder).

Inductor's precompiled headers (``codecache._HEADER_DIR``, by default
``/tmp/torchinductor_<user>/precompiled_headers``: a folder any local user could create
first and fill with a ``.gch`` that every later compile includes) go to the cache folder
in use instead (``install_headers``): the private copy where sealing is on (rebuilt per
process, never published: ~150 MB each, and needed only when a graph is compiled), else
pdserve's own cache under ``~/.cache``.

Stdlib only (torch is imported only by ``install_headers``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve import keys
from pdserve.engine import cache_seal

log = logging.getLogger(__name__)

HEADERS = "precompiled_headers"  # under the cache folder: per process, never published
_NOT_PUBLISHED = (HEADERS, "locks")  # top-level folders of a private copy kept to itself
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# A seam for tests: called with (shared folder, relative path) after a file's bytes were
# read and checked and before they are written to the copy.
after_check: Callable[[Path, str], None] | None = None


PREFIX = "pdserve-compiled-"  # a private copy's folder name: PREFIX, pid, random


def private_dir(prefix: str = PREFIX) -> Path:
    """A new folder only this process's user can reach, removed when the process exits."""
    base = tempfile.gettempdir()
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{base} is not a folder (a link?): no private compile cache there")
    if st.st_uid not in (0, os.geteuid()):
        raise OSError(f"{base} belongs to uid {st.st_uid}: no private compile cache there")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise OSError(f"{base} is writable by others and not sticky")
    _remove_stale(Path(base), prefix)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)  # 0700, O_EXCL, random
    fd = os.open(path, _DIR_FLAGS)
    try:
        got = os.fstat(fd)
    finally:
        os.close(fd)
    if got.st_uid != os.geteuid() or got.st_mode & 0o077:
        raise OSError(f"{path} is not this process's alone")
    atexit.register(shutil.rmtree, path, True)
    return Path(path)


def _remove_stale(base: Path, prefix: str) -> None:
    """Copies left by processes of ours that are gone (killed before their exit handler
    ran: a pod's /tmp outlives its container's restarts)."""
    for entry in base.glob(f"{prefix}*-*"):
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        try:
            st = os.lstat(entry)
            if not pid.isdigit() or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            os.kill(int(pid), 0)  # alive (or another user's process): kept
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def copy_checked(shared: Path, dest: Path, ring_: keys.KeyRing) -> dict[str, str]:
    """Copy every file of ``shared`` whose seal holds, checked on the bytes copied, into
    ``dest``; remove from ``shared`` what is a link, not a regular file, unsealed or
    tampered with. Returns {relative path: seal} of what was copied."""
    copied: dict[str, str] = {}
    removed: list[str] = []
    if not shared.is_dir():
        return copied
    sealed = cache_seal._manifest(shared)
    for root, dirs, names, dir_fd in os.fwalk(shared, follow_symlinks=False):
        rel_root = Path(root).relative_to(shared)
        for name in list(dirs):  # fwalk lists a linked folder as a folder, never enters it
            if stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode):
                dirs.remove(name)
                os.unlink(name, dir_fd=dir_fd)
                removed.append((rel_root / name).as_posix())
        for name in names:
            rel = (rel_root / name).as_posix()
            if cache_seal._own(name):
                continue
            data = _read_checked(dir_fd, name, rel, sealed.get(rel, ""), ring_)
            if data is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dir_fd)
                removed.append(rel)
                continue
            if after_check is not None:
                after_check(shared, rel)
            _write(dest, rel, data)
            copied[rel] = sealed[rel]
    if removed:
        log.warning(
            "compile cache %s: removed %d file(s) without this service's seal "
            "(first: %s); they are compiled again",
            shared,
            len(removed),
            removed[0],
        )
    return copied


def _read_checked(
    dir_fd: int, name: str, rel: str, tag_hex: str, ring_: keys.KeyRing
) -> bytes | None:
    """The bytes of ``name`` when it is a regular file (not a link) whose seal holds on
    exactly those bytes; None otherwise."""
    try:
        want = bytes.fromhex(tag_hex)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a fifo: no wait
        fd = os.open(name, flags, dir_fd=dir_fd)
    except (OSError, ValueError):
        return None
    try:
        if not want or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = b"".join(iter(lambda: os.read(fd, 1 << 20), b""))
    finally:
        os.close(fd)
    digest = hashlib.sha256(data).digest()
    ok = any(keys.mac(k, rel.encode(), digest) == want for k in ring_.keys)
    return data if ok else None


def _write(dest: Path, rel: str, data: bytes) -> None:
    """``data`` at ``dest/rel`` in this process's own folder."""
    path = dest / rel
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(data)


def publish(private: Path, shared: Path, ring_: keys.KeyRing, copied: dict[str, str]) -> int:
    """Write what this process compiled (files of ``private`` not copied in unchanged) to
    ``shared``, sealed with the tags of the bytes written. Returns how many."""
    if not ring_:
        return 0
    new: dict[str, str] = {}
    for path in sorted(p for p in private.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(private).as_posix()
        if rel.split("/", 1)[0] in _NOT_PUBLISHED or cache_seal._own(path.name):
            continue
        data = path.read_bytes()
        tag = keys.mac(ring_.signing, rel.encode(), hashlib.sha256(data).digest()).hex()
        if copied.get(rel) == tag:
            continue
        try:
            _write_shared(shared, rel, data)
        except OSError as exc:  # a planted link on the way, a full volume: not published
            log.warning("compile cache %s: %s not published (%s)", shared, rel, exc)
            continue
        new[rel] = tag
    if new:
        _merge_manifest(shared, new)
    return len(new)


def publish_file(shared: Path, rel: str, data: bytes, ring_: keys.KeyRing) -> None:
    """One file (the attention kernel's library) written to ``shared`` and sealed with the
    tag of ``data`` (what this process built), never of what the folder holds by then."""
    _write_shared(shared, rel, data)
    if ring_:
        tag = keys.mac(ring_.signing, rel.encode(), hashlib.sha256(data).digest()).hex()
        _merge_manifest(shared, {rel: tag})


def _write_shared(shared: Path, rel: str, data: bytes) -> None:
    """``data`` at ``shared/rel``, written under a temporary name and renamed, through
    directory fds opened with O_NOFOLLOW (a planted link on the way is an OSError)."""
    *parts, name = rel.split("/")
    shared.mkdir(parents=True, exist_ok=True)
    fd = os.open(shared, _DIR_FLAGS)
    try:
        for part in parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
        tmp = f".{name}.{os.getpid()}.publish"
        create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(tmp, create, 0o644, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
    finally:
        os.close(fd)


def _merge_manifest(shared: Path, new: dict[str, str]) -> None:
    """The shared manifest with ``new`` added (entries of files gone dropped), replaced
    whole: readers see the old manifest or the new; writers take turns (manifest_lock)."""
    with cache_seal.manifest_lock(shared):
        merged = {
            rel: tag for rel, tag in cache_seal._manifest(shared).items() if (shared / rel).exists()
        }
        merged.update(new)
        cache_seal.write_manifest(shared, merged)


_headers_lock = threading.Lock()
_build_header: Callable[..., str] | None = None  # inductor's own, uncached (install_headers)


def install_headers() -> None:
    """Inductor's precompiled headers under the cache folder in use at each compile
    (``cache_dir()/precompiled_headers``) instead of its import-time default
    ``/tmp/torchinductor_<user>/precompiled_headers`` (module docstring). Once per process:
    ``codecache._precompile_header`` (cached per header and command line) is wrapped so
    that its folder is part of the cache key and set while it runs."""
    global _build_header
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if _build_header is not None:
        return
    _build_header = codecache._precompile_header.__wrapped__

    @functools.cache
    def in_folder(folder: str, header: str, hashable_cmd_line: str, **command: Any) -> str:
        assert _build_header is not None
        with _headers_lock:  # the folder is a module global of inductor's
            codecache._HEADER_DIR = folder
            codecache._HEADER_LOCK_DIR = os.path.join(folder, "locks")
            return str(_build_header(header, hashable_cmd_line, **command))

    def precompile_header(header: str, hashable_cmd_line: str, **command: Any) -> str:
        folder = os.path.join(cache_dir(), HEADERS)
        return str(in_folder(folder, header, hashable_cmd_line, **command))

    codecache._precompile_header = precompile_header  # type: ignore[assignment]
