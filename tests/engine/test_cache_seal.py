"""Compiled code in a shared cache loads only if this service sealed it (engine/cache_seal.py).

The attack: a shared model cache (one PVC) is writable by every service that mounts it;
a library planted in another service's compiled-code folder would be loaded and run by
that service's workers. Without the seal the planted file is used as is (the kernel test
loads it); with it the file is deleted and compiled again.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from pdserve import env, keys
from pdserve.engine import cache_seal, cpu_kernel
from pdserve.testing.engine_probes import symlink_probe

pytestmark = pytest.mark.unit

SECRET, OTHER = "service-a-secret", "service-b-secret"


def _ring(*secrets: str) -> keys.KeyRing:
    return keys.KeyRing(keys.COMPILE_CACHE, secrets)


def test_unsealed_and_tampered_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "graph.so").write_bytes(b"ours")
    (tmp_path / "kernel.py").write_text("x = 1")
    assert cache_seal.seal(tmp_path, _ring(SECRET)) == 2
    (tmp_path / "ab" / "planted.so").write_bytes(b"theirs")  # never sealed
    (tmp_path / "kernel.py").write_text("import os; os.system('id')")  # sealed, then changed
    removed = cache_seal.verify(tmp_path, _ring(SECRET))
    assert sorted(removed) == ["ab/planted.so", "kernel.py"]
    assert (tmp_path / "ab" / "graph.so").read_bytes() == b"ours"


def test_another_services_seal_does_not_count(tmp_path: Path) -> None:
    (tmp_path / "graph.so").write_bytes(b"code")
    cache_seal.seal(tmp_path, _ring(OTHER))
    assert cache_seal.verify(tmp_path, _ring(SECRET)) == ["graph.so"]


def test_rotation_keeps_the_cache(tmp_path: Path) -> None:
    """Sealed under the old secret, checked while rotating (new first, old accepted):
    kept, and resealed under the new one, so the old secret can go."""
    (tmp_path / "graph.so").write_bytes(b"code")
    cache_seal.seal(tmp_path, _ring("old"))
    assert cache_seal.verify(tmp_path, _ring("new", "old")) == []
    (tmp_path / cache_seal.MANIFEST).unlink()
    cache_seal.seal(tmp_path, _ring("new", "old"))
    assert cache_seal.verify(tmp_path, _ring("new")) == []


def test_sealing_is_off_for_a_private_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.SERVICE_SECRET, SECRET)
    monkeypatch.delenv(env.KERNEL_CACHE, raising=False)
    assert not cache_seal.ring(env.KERNEL_CACHE)  # ~/.cache: `pdserve up` draws new secrets
    monkeypatch.setenv(env.KERNEL_CACHE, "/shared/kernels")
    assert cache_seal.ring(env.KERNEL_CACHE)


TINY = 'extern "C" int pdserve_probe() { return 7; }\n'


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_a_planted_kernel_library_is_rebuilt_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "kernels"
    monkeypatch.setenv(env.KERNEL_CACHE, str(cache))
    monkeypatch.setenv(env.SERVICE_SECRET, SECRET)
    source = tmp_path / "probe.cpp"
    source.write_text(TINY)
    flags = ["-O0", "-shared", "-fPIC"]
    built = cpu_kernel.build("g++", source, [], flags)
    assert ctypes.CDLL(str(built)).pdserve_probe() == 7
    # Another tenant writes its own library under the very name the worker will load.
    planted = tmp_path / "planted.cpp"
    planted.write_text(TINY.replace("7", "666"))
    subprocess.run(["g++", *flags, str(planted), "-o", str(built)], check=True)
    again = cpu_kernel.build("g++", source, [], flags)
    assert again == built
    assert cpu_kernel.load_checked(again).pdserve_probe() == 7  # from the checked fd
    # A fresh file (dlopen caches by path+inode: copy to a new name before loading).
    fresh = tmp_path / "load.so"
    shutil.copy(again, fresh)
    assert ctypes.CDLL(str(fresh)).pdserve_probe() == 7, "the planted library was kept"


def test_compile_checks_the_inductor_cache_before_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile_model is where inductor's cache starts to be read: the planted file is gone
    by the time it returns (torch.compile itself is lazy: nothing is compiled here)."""
    import torch

    from pdserve.engine import compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(env.COMPILE_CACHE, str(tmp_path))
    monkeypatch.setenv(env.SERVICE_SECRET, SECRET)
    (tmp_path / "fxgraph").mkdir()
    (tmp_path / "fxgraph" / "entry").write_bytes(b"planted graph")
    compiled.compile_model(torch.nn.Sequential(torch.nn.ReLU()))
    assert not (tmp_path / "fxgraph" / "entry").exists()


def test_planted_symlinks_are_removed_never_followed(tmp_path: Path) -> None:
    assert symlink_probe(tmp_path, SECRET) == 0
    assert not cache_seal._manifest(tmp_path / "cache")  # nothing of theirs got our seal


def test_the_loader_checks_the_file_it_opened(tmp_path: Path) -> None:
    """open_sealed: O_NOFOLLOW (a link is refused), the seal checked on the fd, and what
    the fd reads stays the checked file after the path is swapped."""
    (tmp_path / "k.so").write_bytes(b"ours")
    ring = _ring(SECRET)
    cache_seal.seal(tmp_path, ring)
    fd = cache_seal.open_sealed(tmp_path, tmp_path / "k.so", ring)
    try:
        (tmp_path / "swap").write_bytes(b"theirs")
        os.replace(tmp_path / "swap", tmp_path / "k.so")  # swapped after the check
        assert Path(f"/proc/self/fd/{fd}").read_bytes() == b"ours"
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # the swapped file carries no seal
        cache_seal.open_sealed(tmp_path, tmp_path / "k.so", ring)
    (tmp_path / "k.so").unlink()
    (tmp_path / "sealed").write_bytes(b"ours")
    (tmp_path / "k.so").symlink_to(tmp_path / "sealed")
    with pytest.raises(OSError):  # ELOOP: never followed
        cache_seal.open_sealed(tmp_path, tmp_path / "k.so", _ring())


def test_read_sealed_returns_the_bytes_it_checked(tmp_path: Path) -> None:
    (tmp_path / "k.so").write_bytes(b"ours")
    ring = _ring(SECRET)
    cache_seal.seal(tmp_path, ring)
    assert cache_seal.read_sealed(tmp_path, tmp_path / "k.so", ring) == b"ours"
    (tmp_path / "k.so").write_bytes(b"theirs")  # rewritten in place, same inode
    with pytest.raises(OSError):
        cache_seal.read_sealed(tmp_path, tmp_path / "k.so", ring)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_two_checked_libraries_load_side_by_side(tmp_path: Path) -> None:
    """The loader must not hand back a library it loaded before under the same name (it
    does for two loads of /proc/self/fd/N with one N)."""
    flags = ["-O0", "-shared", "-fPIC"]
    libs = []
    for value in (7, 8):
        source = tmp_path / f"probe{value}.cpp"
        source.write_text(TINY.replace("7", str(value)))
        subprocess.run(
            ["g++", *flags, str(source), "-o", str(tmp_path / f"p{value}.so")], check=True
        )
        libs.append(cpu_kernel.load_checked(tmp_path / f"p{value}.so"))
    assert [lib.pdserve_probe() for lib in libs] == [7, 8]
