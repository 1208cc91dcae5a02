"""Builds and loads the CPU paged-attention kernel (``paged_attention.cpp``).

The kernel is plain C++ with OpenMP and no torch headers, so it compiles in about
a second; it is built on first use with the host's compiler (``-march=native``) into
a cache directory keyed by the source's hash and the CPU (``host_tag.py``), and loaded
with ctypes. Where no compiler is found (or ``PDSERVE_CPU_KERNEL=0``), :func:`load` returns None and
attention falls back to the gather path.

OpenMP: the library links libgomp by soname; torch has loaded its own copy already,
so both share one OpenMP runtime and one thread pool (no oversubscription).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from pdserve import env
from pdserve.engine import cache_seal, sealed_copy
from pdserve.engine.host_tag import host_tag

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cpp")
# part of the cache key; the abi header is also the bench's first kernel's (ABI_HEADER)
ABI_HEADER = Path(__file__).with_name("paged_attention_abi.h")
HEADERS = [Path(__file__).with_name("paged_attention_simd.h"), ABI_HEADER]
# Not -ffast-math: linking a shared library with it pulls in crtfastmath.o, which sets
# flush-to-zero / denormals-are-zero for the whole process on load (torch's numerics and
# every other library's change with it). Nor -fassociative-math: the kernel's vector code
# is written out (intrinsics, or lane-wise loops), and its exp depends on the order of its
# range reduction (x - n*ln2_hi - n*ln2_lo), which reassociation would undo.
FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "pdserve" / "kernels"
    return Path(env.get(env.KERNEL_CACHE) or default)


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def library_path(
    cxx: str, source: Path = SOURCE, headers: list[Path] = HEADERS, flags: list[str] = FLAGS
) -> Path:
    """Where the library of ``source`` is cached: keyed by the hash of its text, its
    headers', the compiler, the flags and the CPU (``-march=native``)."""
    src = b"".join(p.read_bytes() for p in [source, *headers])
    key = hashlib.sha256(src + " ".join([cxx, *flags, host_tag()]).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def build(
    cxx: str, source: Path = SOURCE, headers: list[Path] = HEADERS, flags: list[str] = FLAGS
) -> Path:
    """The compiled library of ``source`` (built once per ``library_path``);
    bench/attention_kernel.py builds the old kernel with it."""
    target = library_path(cxx, source, headers, flags)
    sealing = cache_seal.ring(env.KERNEL_CACHE)  # a shared cache: only our own code loads
    cache_seal.verify(target.parent, sealing)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if sealing:  # built where only we write, sealed as the bytes we built (sealed_copy.py)
        with tempfile.TemporaryDirectory(prefix="pdserve-kernel-build-") as private:
            out = Path(private) / target.name
            subprocess.run(
                [cxx, *flags, str(source), "-o", str(out)],
                check=True,
                capture_output=True,
                text=True,
            )
            sealed_copy.publish_file(target.parent, target.name, out.read_bytes(), sealing)
        return target
    # Compile next to the target and rename: concurrent builders never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cxx, *flags, str(source), "-o", tmp], check=True, capture_output=True, text=True
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def needs_build() -> bool:
    """The kernel can be built here and is not built yet (a first start: its build takes
    a minute or more of one core on a small CPU, so a worker may serve with the gather
    path meanwhile: engine/compile_job.py)."""
    if env.get(env.CPU_KERNEL, "1") == "0" or load.cache_info().currsize:
        return False
    cxx = _compiler()
    return cxx is not None and not library_path(cxx).exists()


@cache
def load() -> ctypes.CDLL | None:
    """The kernel library, or None where it cannot be built here."""
    if env.get(env.CPU_KERNEL, "1") == "0":
        return None
    cxx = _compiler()
    if cxx is None:
        logger.warning("no C++ compiler found: CPU attention uses the slower gather path")
        return None
    try:
        lib = load_checked(build(cxx))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU attention kernel failed to build (%s); using the gather path", detail)
        return None
    declare(lib)
    return lib


def load_checked(path: Path) -> ctypes.CDLL:
    """``path`` loaded as the bytes that were checked: opened with O_NOFOLLOW, a regular
    file, read once, its seal verified on those bytes (a shared cache), and they are what
    is loaded, from a private copy (a file swapped or rewritten in the cache after the
    check is never the one that runs; /proc/self/fd/N would not do: the loader reuses a
    library it loaded before under the same name)."""
    data = cache_seal.read_sealed(path.parent, path, cache_seal.ring(env.KERNEL_CACHE))
    with tempfile.TemporaryDirectory(prefix="pdserve-kernel-") as private:
        copy = Path(private) / path.name
        copy.write_bytes(data)
        return ctypes.CDLL(str(copy))  # mapped: the copy may go with its folder


def declare(lib: ctypes.CDLL) -> None:
    """Argument types of the kernel's entry points (any build of the kernel has the first)."""
    fn = lib.pdserve_paged_attention
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [i32, ptr, i64, i64, ptr, ptr, ptr, ptr, i32, ptr, ptr, ptr]
    fn.argtypes += [i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = ctypes.c_int
    if hasattr(lib, "pdserve_paged_attention_layer"):  # with one layer's options
        layer = lib.pdserve_paged_attention_layer
        layer.argtypes = [*fn.argtypes[:-1], i32, ctypes.c_float, ptr, i32]
        layer.restype = ctypes.c_int
    if hasattr(lib, "pdserve_kernel_width"):
        lib.pdserve_kernel_width.argtypes, lib.pdserve_kernel_width.restype = [i32], i32
        lib.pdserve_kernel_exp.argtypes = [i32, ptr, ptr, i64]
        lib.pdserve_kernel_exp.restype = i32


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel handles this model (its fixed limits: G <= 8, D <= 256)."""
    return (
        dtype in DTYPE_CODES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= 8
        and head_dim <= 256
    )
