"""Model files in a shared cache load only as they were when this service first loaded them.

Weights, tokenizer and chat template decide what a worker computes and what text it
emits (a swapped chat template is a prompt injection in every request; a swapped
tokenizer or weight file, silently wrong answers). In a shared model cache (one PVC
mounted by several services) they are written by the operator's download init container
and read by every service. So, as engine/cache_seal.py seals compiled code, the model's
files are sealed too: the first load of the service writes a manifest of every file's
SHA-256 and an HMAC over it under the service's ``compile-cache`` key, into the service's
own compiled-code folder; every later load checks each file against it. A changed file, a
file missing or added (a planted ``chat_template.jinja``), a symlink or anything not a
regular file is refused with ``ModelSealError`` naming the file; the worker does not start.

What is loaded is what was hashed (``load``): the folder is walked with ``os.fwalk``
(directory fds, symlinks never followed), each file opened with ``O_NOFOLLOW`` relative to
its directory's fd, checked to be a regular file (``fstat``) and read once; its bytes are
hashed, then used. The weights (``*.safetensors``) are parsed from those bytes
(``safetensors.torch.load``) and handed to ``from_pretrained`` as a state dict; every other
file (config, tokenizer, chat template) is copied from those bytes into a private 0700
folder, which transformers then reads. A file swapped or rewritten after it was read is
never loaded, and no file is read twice. The cost: a weights file is held in memory as
bytes while its tensors are made (peak about twice the largest shard, not a mmap).

The router and a decode pod's front (router/tokenizer.py) load their tokenizer the same
way, without the weights: they never read them and never write a manifest (a router's
folder may hold only the tokenizer while the workers' download goes on); they wait for
the manifest a worker writes on the service's first load (within the pod's startup
probe), then check the tokenizer files, the chat template and the config against it and
load them from their private copy.

Active where the compile cache's sealing is (``PDSERVE_COMPILE_CACHE`` set and a service
secret: the operator's shared cache); ``pdserve up`` and a private cache are left alone.
A new revision downloaded by the operator's init container (an unpinned model whose hub
repo moved on: ``hf download --local-dir`` records each file's commit) gets a manifest of
its own; a model changed by hand on purpose needs its manifest deleted
(``rm <compile cache>/.pdserve-model-seal-*.json``).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import env, keys
from pdserve.engine import cache_seal

log = logging.getLogger(__name__)
PREFIX = cache_seal.MODEL_SEAL  # + a digest of the model's path; cache_seal leaves it be
WEIGHTS = ".safetensors"  # parsed from the verified bytes; every other file is copied
_SKIP_DIRS = {".cache"}  # hf download --local-dir's own bookkeeping
LOAD, CHECK, SKIP = "load", "check", "skip"  # what load() does with the weights
SEAL_POLL_S = 2.0  # a router waiting for the workers' seal looks this often
IDENTITY_HEAD = 1 << 20  # model_identity: the first MiB of each weights file


class ModelSealError(RuntimeError):
    """A model file does not match the seal written when the service first loaded it."""


@dataclass
class SealedModel:
    """A model's files as verified: ``files`` is a private (0700) folder holding a copy of
    every file but the weights, written from the bytes that were hashed; ``weights`` the
    tensors parsed from the weights' hashed bytes (None once taken, or for a router)."""

    source: Path
    files: Path
    identity: str = ""  # model_identity over the verified bytes ("" without the weights)
    weights: dict[str, Any] | None = field(default=None, repr=False)

    def take_weights(self) -> dict[str, Any] | None:
        """The weights' tensors, handed over once (a later load reads and checks again)."""
        weights, self.weights = self.weights, None
        return weights


_loaded: dict[str, SealedModel] = {}  # model folder -> its verified files, in this process


def identity(config: bytes, weights: Iterable[tuple[str, int, bytes]]) -> str:
    """A short fingerprint of config and weights (name, size, first MiB of each top-level
    weights file, by name); peers must agree on it (engine/model_runner.model_identity)."""
    h = hashlib.sha256(config)
    for name, size, head in sorted(weights):
        h.update(name.encode())
        h.update(str(size).encode())
        h.update(head[:IDENTITY_HEAD])
    return h.hexdigest()[:16]


def revision(model_dir: Path) -> str:
    """The hub commit(s) ``hf download --local-dir`` recorded for the folder's files (the
    first line of each ``.cache/huggingface/download/*.metadata``); "" for a folder
    placed otherwise."""
    commits = set()
    for meta in (model_dir / ".cache" / "huggingface" / "download").rglob("*.metadata"):
        try:
            commits.add(meta.read_text(errors="replace").split("\n", 1)[0].strip())
        except OSError:
            continue
    return ",".join(sorted(commits))


def _manifest_path(folder: Path, model_dir: Path) -> Path:
    """One manifest per model folder and revision: the operator's init container downloads
    a new revision when the hub has one (an unpinned model), and that is sealed anew."""
    key = f"{model_dir}\0{revision(model_dir)}"
    return folder / f"{PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read(dir_fd: int, name: str, rel: str) -> bytes:
    """The file ``name`` of the directory ``dir_fd``, read once from one opened fd: never
    through a symlink, only a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise ModelSealError(f"model file {rel}: {exc.strerror} (a symlink is refused)") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelSealError(f"model file {rel} is not a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, max(min(st.st_size - size, 64 << 20), 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _walk(model_dir: Path) -> dict[str, tuple[int, str]]:
    """Every file of the model folder: relative path -> (its directory's fd, its name).
    A symlink or a special file anywhere is refused (never followed). The fds stay open
    until ``_close`` (files are opened relative to them: a directory swapped for a link
    after the walk is not followed either)."""
    out: dict[str, tuple[int, str]] = {}
    fds: list[int] = []
    try:
        for root, dirs, names, dir_fd in os.fwalk(model_dir, follow_symlinks=False):
            here = Path(root)
            held = os.dup(dir_fd)
            fds.append(held)
            for name in [*dirs, *names]:
                rel = (here / name).relative_to(model_dir).as_posix()
                mode = os.lstat(name, dir_fd=dir_fd).st_mode
                if stat.S_ISLNK(mode):
                    raise ModelSealError(f"model file {rel} is a symlink: refused")
                if stat.S_ISREG(mode):
                    out[rel] = (held, name)
                elif not stat.S_ISDIR(mode):
                    raise ModelSealError(f"model file {rel} is not a regular file")
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS or here != model_dir]
    except BaseException:
        _close(fds)
        raise
    return out


def _close(fds: Iterable[int]) -> None:
    for fd in set(fds):
        os.close(fd)


def _body(model_dir: Path, files: dict[str, str]) -> bytes:
    return json.dumps({"model": str(model_dir), "files": files}, sort_keys=True).encode()


def _private_dir() -> Path:
    where = Path(tempfile.mkdtemp(prefix="pdserve-model-"))  # 0700, this process's own
    owner = os.getpid()

    def remove() -> None:  # by its maker alone: a forked child's exit leaves it be
        if os.getpid() == owner:
            shutil.rmtree(where, ignore_errors=True)

    atexit.register(remove)
    return where


def load(
    model: str,
    ring: keys.KeyRing | None = None,
    folder: Path | None = None,
    weights: str = LOAD,
    wait_s: float = 0.0,
) -> SealedModel | None:
    """``model``'s files read once and checked against the service's seal (written on the
    service's first load); None where sealing is off (load by path then). ``weights``:
    ``LOAD`` parses them too (a worker), ``CHECK`` only hashes them, ``SKIP`` never reads
    them and never writes a seal (a router: its folder may hold only the tokenizer while
    the workers' download goes on), waiting up to ``wait_s`` for a worker's seal instead.
    ``ModelSealError`` names the first file that differs."""
    ring = cache_seal.ring(env.COMPILE_CACHE) if ring is None else ring
    where = folder or Path(env.get(env.COMPILE_CACHE) or ".")
    model_dir = Path(model).resolve()
    if not ring or not model_dir.is_dir():
        return None
    done = _loaded.get(str(model_dir))
    if done is not None and (done.weights is not None or weights != LOAD):
        return done
    manifest = _manifest_path(where, model_dir)
    want = _sealed(manifest, model_dir, ring)
    deadline = time.monotonic() + wait_s
    while want is None and weights == SKIP:
        if time.monotonic() >= deadline:
            raise ModelSealError(
                f"model {model_dir}: no seal ({manifest}) yet: a worker of the service seals "
                "the model when it first loads it; the tokenizer is loaded only from a "
                "sealed model"
            )
        log.info("model %s: waiting for a worker's seal (%s)", model_dir, manifest.name)
        time.sleep(min(SEAL_POLL_S, max(deadline - time.monotonic(), 0.0)))
        want = _sealed(manifest, model_dir, ring)
    names = _walk(model_dir)
    try:
        if want is not None:
            _same_names(model_dir, set(want), set(names), manifest)
        sealed, hashes = _read_all(model_dir, names, want, manifest, weights)
    finally:
        _close(fd for fd, _ in names.values())
    if want is None:
        _write(manifest, model_dir, hashes, ring)
    _loaded[str(model_dir)] = sealed
    return sealed


def _read_all(
    model_dir: Path,
    names: dict[str, tuple[int, str]],
    want: dict[str, str] | None,
    manifest: Path,
    weights: str,
) -> tuple[SealedModel, dict[str, str]]:
    """Each file read once, hashed and checked against ``want`` before it is used."""
    sealed = SealedModel(model_dir, _private_dir(), weights={} if weights == LOAD else None)
    hashes: dict[str, str] = {}
    heads: list[tuple[str, int, bytes]] = []
    config = b""
    for rel in sorted(names):
        is_weights = rel.endswith(WEIGHTS)
        if is_weights and weights == SKIP:
            continue  # a router: the weights are neither needed nor read
        data = _read(*names[rel], rel)
        hashes[rel] = hashlib.sha256(data).hexdigest()
        if want is not None and want[rel] != hashes[rel]:
            raise ModelSealError(
                f"model file {rel} changed since the model was sealed (model {model_dir}, "
                f"seal {manifest.name}): refusing to load it; if the model was updated on "
                "purpose, delete the seal"
            )
        if is_weights:
            if "/" not in rel:
                heads.append((rel, len(data), data[:IDENTITY_HEAD]))
            if sealed.weights is not None:
                from safetensors.torch import load as parse

                sealed.weights.update(parse(data))
            continue
        if rel == "config.json":
            config = data
        _copy(sealed.files, rel, data)
    if weights != SKIP:
        sealed.identity = identity(config, heads)
    return sealed, hashes


def _copy(private: Path, rel: str, data: bytes) -> None:
    path = private / rel
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _sealed(manifest: Path, model_dir: Path, ring: keys.KeyRing) -> dict[str, str] | None:
    """The file hashes of the seal (None: none yet); refused unless its MAC is ours."""
    try:
        sealed = json.loads(manifest.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ModelSealError(f"model seal {manifest}: unreadable ({exc})") from exc
    want = sealed.get("files") if isinstance(sealed, dict) else None
    tag = str(sealed.get("mac", "")) if isinstance(sealed, dict) else ""
    files = {str(a): str(b) for a, b in want.items()} if isinstance(want, dict) else None
    if files is None or not any(
        keys.mac(k, _body(model_dir, files)).hex() == tag for k in ring.keys
    ):
        raise ModelSealError(
            f"model seal {manifest} does not carry this service's seal: refusing to load "
            f"{model_dir}"
        )
    return files


def _same_names(model_dir: Path, want: set[str], have: set[str], manifest: Path) -> None:
    for rel in sorted(want ^ have):
        why = "is missing" if rel in want else "was added after the model was sealed"
        raise ModelSealError(
            f"model file {rel} {why} (model {model_dir}, seal {manifest.name}): refusing to "
            "load it; if the model was updated on purpose, delete the seal"
        )


def _write(manifest: Path, model_dir: Path, files: dict[str, str], ring: keys.KeyRing) -> None:
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tag = keys.mac(ring.signing, _body(model_dir, files)).hex()
    fd, tmp = tempfile.mkstemp(dir=manifest.parent, suffix=".seal")
    with os.fdopen(fd, "w") as f:
        json.dump({"files": files, "mac": tag}, f)
    os.replace(tmp, manifest)
    log.info("model %s: %d files sealed (%s)", model_dir, len(files), manifest.name)


def check(model: str, ring: keys.KeyRing | None = None, folder: Path | None = None) -> bool:
    """Seal or check every file of ``model`` without making the weights' tensors; True when
    a check or seal ran (bench/chaos_isolation.py, tests)."""
    return load(model, ring, folder, CHECK) is not None
