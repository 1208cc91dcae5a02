"""Compiled code is cached per kind of CPU: a cache another CPU filled is never used.

The fault: inductor's graph cache does not key on the vector ISA it generated code for.
With one cache shared by an AVX-512 and an AVX2 run (a volume on two nodes, an image
baked elsewhere, another ATEN_CPU_CAPABILITY), the AVX2 run got the AVX-512 kernels and
built them with 8-lane vectors for 16-lane loops: a compiled tiny model gave NaN logits
and every greedy token 0, silently. engine/host_tag.py keys both caches by the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine import cpu_kernel, host_tag

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

# An RMSNorm (a vectorised reduction) compiled with dynamic shapes, as the engine compiles
# the model (the engine's C++ wrapper only calls the same kernels: left out, 10 s faster);
# prints the vector ISA inductor generated for, the largest error against eager and the
# cache.
PROBE = """
import pdserve.engine  # first, as in a worker: inductor's cache directory, its ISA probe's path
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from pdserve.engine import compiled
def f(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
x, w = torch.randn(3, 100), torch.randn(100)
got = torch.compile(f, dynamic=True)(x, w)
print(str(pick_vec_isa()).split()[0], float((got - f(x, w)).abs().max()), compiled.cache_dir())
"""


def _probe(cache: Path, capability: str) -> tuple[str, float, Path]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(PDSERVE_COMPILE_CACHE=str(cache), ATEN_CPU_CAPABILITY=capability)
    # Inductor proves each vector ISA the CPU lists by building and loading a test library
    # in the (here empty) cache: four g++ runs a probe, ~60% of its CPU. The ISA is still
    # picked from the CPU's flags and ATEN_CPU_CAPABILITY, and the fault still shows with
    # the check skipped (one cache for both: the AVX2 run's error is NaN).
    env["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    isa, error, used = out.stdout.split()[-3:]
    return isa, float(error), Path(used)


@pytest.mark.skipif(
    not {"avx512f", "avx2"} <= set(host_tag.cpu_flags()), reason="needs an AVX-512 CPU"
)
def test_a_cache_filled_for_another_isa_is_not_used(tmp_path: Path) -> None:
    wide_isa, wide_error, wide_dir = _probe(tmp_path, "avx512")
    narrow_isa, narrow_error, narrow_dir = _probe(tmp_path, "avx2")  # same PDSERVE_COMPILE_CACHE
    assert (wide_isa, narrow_isa) == ("avx512", "avx2")  # the fault's condition holds
    assert wide_error < 1e-5
    assert narrow_error < 1e-5, "AVX2 code ran on AVX-512 kernels from the shared cache"
    assert wide_dir != narrow_dir
    assert wide_dir.parent == narrow_dir.parent == tmp_path


def test_host_tag_follows_the_cpu_and_aten_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    def tag() -> str:
        host_tag.host_tag.cache_clear()
        return host_tag.host_tag()

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    base = tag()
    assert base == tag() and base.split("-")[0]  # stable, names the machine
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert tag() != base
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    flags = host_tag.cpu_flags()
    monkeypatch.setattr(host_tag, "cpu_flags", lambda: [f for f in flags if f != "avx2"] + ["x"])
    assert tag() != base
    monkeypatch.undo()
    assert tag() == base


def test_attention_kernel_library_is_keyed_by_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    here = cpu_kernel.library_path("g++")
    monkeypatch.setattr(cpu_kernel, "host_tag", lambda: "x86_64-another")
    assert cpu_kernel.library_path("g++") != here
    assert cpu_kernel.library_path("g++").parent == here.parent


def test_cpu_flags_without_cpuinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(host_tag, "CPUINFO", tmp_path / "absent")
    assert len(host_tag.cpu_flags()) == 1  # the processor's name stands in
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nflags\t\t: sse avx2 sse avx\n")
    monkeypatch.setattr(host_tag, "CPUINFO", tmp_path / "cpuinfo")
    assert host_tag.cpu_flags() == ["avx", "avx2", "sse"]
