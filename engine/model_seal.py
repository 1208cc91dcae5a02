"""Model files in a shared cache load only as they were when this service first loaded them.

Weights, tokenizer and chat template decide what a worker computes and what text it
emits (a swapped chat template is a prompt injection in every request; a swapped
tokenizer or weight file, silently wrong answers). In a shared model cache (one PVC
mounted by several services) they are written by the operator's download init container
and read by every service. So, as engine/cache_seal.py seals compiled code, the model's
files are sealed too: the first worker of the service to load the model writes a
manifest of every file's SHA-256 (the model folder walked with ``lstat``), and an HMAC
over the manifest under the service's ``compile-cache`` key, into the service's own
compiled-code folder; every later load checks each file against it, opened with
``O_NOFOLLOW`` and hashed from the opened fd (a regular file), before the tokenizer,
config or weights are read. A changed file, a file missing or added (a planted
``chat_template.jinja``), a symlink or anything not a regular file is refused with
``ModelSealError`` naming the file; the worker does not start.

Active where the compile cache's sealing is (``PDSERVE_COMPILE_CACHE`` set and a service
secret: the operator's shared cache); ``pdserve up`` and a private cache are left alone.
A new revision downloaded by the operator's init container (an unpinned model whose hub
repo moved on: ``hf download --local-dir`` records each file's commit) gets a manifest of
its own; a model changed by hand on purpose needs its manifest deleted
(``rm <compile cache>/.pdserve-model-seal-*.json``).

Left open: the files are checked, then loaded by path (transformers and safetensors
open them again); a swap in between is not caught. The pod policy keeps every other
writer off the volume (docs/security.md), so that window is the operator's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from pdserve import env, keys
from pdserve.engine import cache_seal

log = logging.getLogger(__name__)
PREFIX = cache_seal.MODEL_SEAL  # + a digest of the model's path; cache_seal leaves it be
_SKIP_DIRS = {".cache"}  # hf download --local-dir's own bookkeeping
_checked: set[str] = set()  # model folders checked in this process


class ModelSealError(RuntimeError):
    """A model file does not match the seal written when the service first loaded it."""


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


def _hash(path: Path, rel: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ModelSealError(f"model file {rel}: {exc.strerror} (a symlink is refused)") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelSealError(f"model file {rel} is not a regular file")
        digest = hashlib.sha256()
        for chunk in iter(lambda: os.read(fd, 4 << 20), b""):
            digest.update(chunk)
        return digest.hexdigest()
    finally:
        os.close(fd)


def _walk(model_dir: Path) -> dict[str, str]:
    """Every file of the model folder and its SHA-256; a symlink or a special file anywhere
    is refused (never followed)."""
    out: dict[str, str] = {}
    for root, dirs, names in os.walk(model_dir):
        here = Path(root)
        for name in [*dirs, *names]:
            path = here / name
            rel = path.relative_to(model_dir).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise ModelSealError(f"model file {rel} is a symlink: refused")
            if stat.S_ISREG(mode):
                out[rel] = _hash(path, rel)
            elif not stat.S_ISDIR(mode):
                raise ModelSealError(f"model file {rel} is not a regular file")
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS or here != model_dir]
    return out


def _body(model_dir: Path, files: dict[str, str]) -> bytes:
    return json.dumps({"model": str(model_dir), "files": files}, sort_keys=True).encode()


def check(model: str, ring: keys.KeyRing | None = None, folder: Path | None = None) -> bool:
    """Seal ``model``'s files on the service's first load, check them on every later one;
    True when a check or seal ran. ``ModelSealError`` names the first file that differs."""
    ring = cache_seal.ring(env.COMPILE_CACHE) if ring is None else ring
    where = folder or Path(env.get(env.COMPILE_CACHE) or ".")
    model_dir = Path(model).resolve()
    if not ring or not model_dir.is_dir() or str(model_dir) in _checked:
        return False
    files = _walk(model_dir)
    manifest = _manifest_path(where, model_dir)
    try:
        sealed = json.loads(manifest.read_text())
    except FileNotFoundError:
        sealed = None
    except (OSError, ValueError) as exc:
        raise ModelSealError(f"model seal {manifest}: unreadable ({exc})") from exc
    if sealed is None:
        where.mkdir(parents=True, exist_ok=True)
        tag = keys.mac(ring.signing, _body(model_dir, files)).hex()
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".seal")
        with os.fdopen(fd, "w") as f:
            json.dump({"files": files, "mac": tag}, f)
        os.replace(tmp, manifest)
        log.info("model %s: %d files sealed (%s)", model_dir, len(files), manifest.name)
    else:
        _verify(model_dir, files, sealed, ring, manifest)
    _checked.add(str(model_dir))
    return True


def _verify(
    model_dir: Path, files: dict[str, str], sealed: object, ring: keys.KeyRing, manifest: Path
) -> None:
    want = sealed.get("files") if isinstance(sealed, dict) else None
    tag = str(sealed.get("mac", "")) if isinstance(sealed, dict) else ""
    if not isinstance(want, dict) or not any(
        keys.mac(k, _body(model_dir, {str(a): str(b) for a, b in want.items()})).hex() == tag
        for k in ring.keys
    ):
        raise ModelSealError(
            f"model seal {manifest} does not carry this service's seal: refusing to load "
            f"{model_dir}"
        )
    for rel in sorted(set(want) | set(files)):
        if rel not in files:
            why = "is missing"
        elif rel not in want:
            why = "was added after the model was sealed"
        elif files[rel] != want[rel]:
            why = "changed since the model was sealed"
        else:
            continue
        raise ModelSealError(
            f"model file {rel} {why} (model {model_dir}, seal {manifest.name}): refusing to "
            "load it; if the model was updated on purpose, delete the seal"
        )
