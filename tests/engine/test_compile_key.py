"""Inductor's C++ cache keys do not hold the venv's path (engine/compile_key.py).

The fault: the key of each C++ file inductor builds holds its command line, which names
torch's folders inside the venv, so every new checkout rebuilt every compiled family's
kernels (~15 CPU-min). The first test builds one library through inductor's own C++
cache, then again as a second venv would (torch's folder spelled through another path):
without the fix the second builds a second library. The others check that the key still
changes with what decides the code: flags, torch, the compiler, other paths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch._inductor import codecache, cpp_builder
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch.utils import cpp_extension

from pdserve.engine import compile_key

pytestmark = pytest.mark.unit

SOURCE = 'extern "C" int pdserve_answer() { return 42; }'


def _libraries(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.so"))


def test_a_second_venv_path_reuses_the_built_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compile_key.install()
    pick_vec_isa()  # the ISA probe's own builds, in the real cache (once per process)
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(codecache.CppCodeCache, "cache", {})
    assert codecache.CppCodeCache.load(SOURCE).pdserve_answer() == 42
    built = _libraries(cache)
    assert len(built) == 1
    # Another checkout's venv: the same torch, reached through another folder.
    other = tmp_path / "clone" / ".venv" / "lib" / "site-packages" / "torch"
    other.parent.mkdir(parents=True)
    other.symlink_to(os.path.dirname(cpp_extension.TORCH_LIB_PATH))
    monkeypatch.setattr(cpp_extension, "_TORCH_PATH", str(other))
    monkeypatch.setattr(cpp_extension, "TORCH_LIB_PATH", str(other / "lib"))
    monkeypatch.setattr(codecache.CppCodeCache, "cache", {})  # a new process
    command = cpp_builder.CppBuilder(
        "o", "i", cpp_builder.CppTorchDeviceOptions(device_type="cpu")
    ).get_command_line()
    assert f"-I{other}/include" in command  # the line really names the other folder
    assert codecache.CppCodeCache.load(SOURCE).pdserve_answer() == 42
    assert _libraries(cache) == built, "the second venv path built its own library"


def _line(torch_dir: str, flags: str = "-O3", python: str = "/usr/include/python3.11") -> str:
    return (
        f"g++ i -D X {flags} -march=native -I{python} -I{torch_dir}/include "
        f"-I{torch_dir}/include/torch/csrc/api/include -c -o o.o -L{torch_dir}/lib -ltorch"
    )


def test_the_key_still_changes_with_flags_torch_compiler_and_other_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    here = os.path.dirname(cpp_extension.TORCH_LIB_PATH)
    key = compile_key.stable_extra(_line(here))
    assert here not in key and "-ltorch" in key
    assert compile_key.stable_extra(_line(here, "-O1")) != key
    assert compile_key.stable_extra(_line(here, python="/opt/py/include/python3.11")) != key
    # torchvision's folder is not torch's: it stays as it is
    assert f"{here}vision" in compile_key.stable_extra(_line(here + "vision"))
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert compile_key.stable_extra(_line(here)) != key
    monkeypatch.undo()
    assert compile_key.stable_extra(_line(here)) == key
    monkeypatch.setattr(cpp_builder, "get_compiler_version_info", lambda cxx: "gcc 99")
    assert compile_key.stable_extra(_line(here)) != key


def test_a_line_without_torch_keeps_inductors_own_key() -> None:
    line = "g++ i -O3 -I/usr/include/python3.11 -c -o o.o"
    assert compile_key.stable_extra(line) == line
