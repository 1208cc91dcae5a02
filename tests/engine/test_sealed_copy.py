"""A sealed shared compile cache is used only as the bytes that were checked
(engine/sealed_copy.py; issue 44 item 4's last piece).

The attack: whoever can write the shared cache swaps an entry after the worker checked
its seal and before inductor loads it (at the first call of a graph variant, long after
``compile_model`` returned). Before, inductor opened the swapped file by path: a pickled
FX-graph / AOTAutograd entry or a generated ``.py`` ran the attacker's code. Now inductor
reads a private copy of the checked bytes, and what the worker compiles is published back
sealed as the bytes it wrote, so the next worker still reuses the graphs.
"""

from __future__ import annotations

import os
import pickle
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import env, keys
from pdserve.engine import cache_seal, compiled, sealed_copy

pytestmark = pytest.mark.unit

SECRET = "service-a-secret"


def _ring(*secrets: str) -> keys.KeyRing:
    return keys.KeyRing(keys.COMPILE_CACHE, secrets)


class _Payload:
    """A pickle that runs ``code`` when loaded (what a planted cache entry can do)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


def _swap_entries(shared: Path, marker: Path) -> int:
    """Replace every pickled graph entry and generated module of ``shared`` (new inodes
    under the same names, as a writer of the volume would) with code that leaves
    ``marker``; returns how many."""
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    swapped = 0
    for path in sorted(shared.rglob("*")):
        if not path.is_file() or cache_seal._own(path.name):
            continue
        rel = path.relative_to(shared).as_posix()
        if path.suffix == ".py":
            data = code.encode()
        elif rel.startswith(("fxgraph/", "aotautograd/")):
            data = pickle.dumps(_Payload(code))
        else:
            continue
        tmp = path.with_name(path.name + ".swap")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        swapped += 1
    return swapped


class _Model(torch.nn.Module):  # one C++ kernel: the graph's cost is not the point
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


def _new_process() -> None:
    """What a new worker process starts without: dynamo's and inductor's in-memory caches."""
    from torch._inductor import codecache

    torch._dynamo.reset()
    for cls in (
        codecache.PyCodeCache,
        codecache.CppCodeCache,
        codecache.CppPythonBindingsCodeCache,
    ):
        cls.cache_clear()


def test_a_graph_swapped_after_the_check_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    pick_vec_isa()  # the ISA probe's own builds, in the real cache (once per process)
    shared = tmp_path / "cache" / "host"
    monkeypatch.setenv(env.COMPILE_CACHE, str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    monkeypatch.setenv(env.SERVICE_SECRET, SECRET)
    monkeypatch.setattr(compiled, "_models_compiled", 5)  # never trim the process's guards
    x = torch.randn(3, 16)
    want = _Model()(x)
    # Precompiled headers cost ~150 MB and seconds each: off here (their folder: below).
    with torch._inductor.config.patch(cpp_cache_precompile_headers=False):
        # A first worker compiles the graph and, once serving, seals it into the cache.
        _new_process()
        model = _Model()
        compiled.prepare(model)
        torch.testing.assert_close(torch.compile(model, dynamic=True)(x), want)
        compiled.in_service()
        manifest = cache_seal._manifest(shared)
        assert any(rel.startswith("fxgraph/") for rel in manifest), sorted(manifest)
        # A second worker checks the cache; then, before its first call loads the graph,
        # every entry is swapped for code of the attacker's.
        _new_process()
        model = _Model()
        compiled.prepare(model)
        marker = tmp_path / "attacker-code-ran"
        assert _swap_entries(shared, marker) >= 2
        before = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
        try:
            got: torch.Tensor | Exception = torch.compile(model, dynamic=True)(x)
        except Exception as exc:  # what a loaded payload leaves inductor with
            got = exc
        hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] - before
    assert not marker.exists(), "a cache entry swapped after the check was loaded"
    assert isinstance(got, torch.Tensor), got
    torch.testing.assert_close(got, want)
    # At least one: under xdist an engine that an earlier test left compiling in the
    # background hits the cache beside this call (a fresh-clone make test read 44 here);
    # run alone it is exactly 1.
    assert hits >= 1, "the sealed graph was not reused"


def test_the_copy_holds_the_bytes_that_were_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap while the copy is made (the seam after each file's check) changes nothing
    in the copy; what is unsealed, tampered with or a link is removed from the cache."""
    shared, private = tmp_path / "shared", tmp_path / "private"
    (shared / "ab").mkdir(parents=True)
    (shared / "ab" / "graph.py").write_text("x = 1")
    (shared / "kernel.so").write_bytes(b"ours")
    ring = _ring(SECRET)
    cache_seal.seal(shared, ring)
    (shared / "planted.py").write_text("import os")
    (shared / "linked").symlink_to(tmp_path, target_is_directory=True)

    def swap(folder: Path, rel: str) -> None:
        (folder / rel).write_bytes(b"theirs")  # in place, after the check

    monkeypatch.setattr(sealed_copy, "after_check", swap)
    copied = sealed_copy.copy_checked(shared, private, ring)
    assert sorted(copied) == ["ab/graph.py", "kernel.so"]
    assert (private / "ab" / "graph.py").read_text() == "x = 1"
    assert (private / "kernel.so").read_bytes() == b"ours"
    assert not (shared / "planted.py").exists() and not os.path.lexists(shared / "linked")
    # The swapped files fail their seal at the next worker's copy.
    monkeypatch.setattr(sealed_copy, "after_check", None)
    assert sealed_copy.copy_checked(shared, tmp_path / "next", ring) == {}


def test_published_files_are_sealed_as_written_and_never_written_through_a_link(
    tmp_path: Path,
) -> None:
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir()
    (private / "ab").mkdir(parents=True)
    (private / "ab" / "graph.py").write_text("y = 2")
    (private / "cd").mkdir()
    (private / "cd" / "k.so").write_bytes(b"built")
    (private / sealed_copy.HEADERS).mkdir()
    (private / sealed_copy.HEADERS / "h.gch").write_bytes(b"per process")
    outside = tmp_path / "outside"
    outside.mkdir()
    (shared / "cd").symlink_to(outside, target_is_directory=True)  # planted on the way
    ring = _ring(SECRET)
    assert sealed_copy.publish(private, shared, ring, {}) == 1
    assert list(outside.iterdir()) == []  # nothing written through the link
    assert not (shared / sealed_copy.HEADERS).exists()
    copied = sealed_copy.copy_checked(shared, tmp_path / "next", ring)
    assert copied == {"ab/graph.py": cache_seal._manifest(shared)["ab/graph.py"]}
    # Unchanged files copied in are not written again.
    assert sealed_copy.publish(tmp_path / "next", shared, ring, copied) == 0


def _publish_many(shared: str, tag: str, count: int) -> None:
    """One worker publishing ``count`` files one at a time (a manifest merge each)."""
    ring = _ring(SECRET)
    for i in range(count):
        sealed_copy.publish_file(Path(shared), f"{tag}/{i}.so", f"{tag}{i}".encode(), ring)


def test_two_workers_publishing_at_once_keep_each_others_seals(tmp_path: Path) -> None:
    """Two replicas compiling at once: every file either publishes stays sealed. Without
    the manifest lock the later rename dropped the earlier merge's entries (~a third of
    them here), and the next worker recompiled what was already built."""
    import multiprocessing

    shared = tmp_path / "shared"
    shared.mkdir()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_publish_many, args=(str(shared), t, 60)) for t in "ab"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    sealed = cache_seal._manifest(shared)
    assert sorted(sealed) == sorted(f"{t}/{i}.so" for t in "ab" for i in range(60))
    assert len(sealed_copy.copy_checked(shared, tmp_path / "next", _ring(SECRET))) == 120


def test_the_private_folder_is_this_processs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = sealed_copy.private_dir()
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    open_base = tmp_path / "open"
    open_base.mkdir()
    open_base.chmod(0o777)  # writable by everyone, not sticky: another user could swap
    monkeypatch.setattr(tempfile, "tempdir", str(open_base))
    with pytest.raises(OSError, match="not sticky"):
        sealed_copy.private_dir()
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(linked))
    with pytest.raises(OSError, match="not a folder"):
        sealed_copy.private_dir()


def test_precompiled_headers_go_to_the_cache_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not inductor's /tmp/torchinductor_<user>/precompiled_headers, which any local user
    can create first: the folder follows the cache in use (the private copy)."""
    from torch._inductor import codecache

    sealed_copy.install_headers()
    seen: list[str] = []

    def build(header: str, line: str, **command: Any) -> str:
        seen.append(codecache._HEADER_DIR)
        return os.path.join(codecache._HEADER_DIR, "h.h")

    monkeypatch.setattr(sealed_copy, "_build_header", build)
    for folder in (tmp_path / "a", tmp_path / "b"):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
        got = codecache._precompile_header(f"{folder.name}.h", "g++ -O3")
        assert got == str(folder / sealed_copy.HEADERS / "h.h")
    assert seen == [str(tmp_path / n / sealed_copy.HEADERS) for n in "ab"]
    assert not any("torchinductor_" in s for s in seen)


def test_copies_of_processes_that_are_gone_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = tmp_path / "pdserve-compiled-999999999-abc"  # no such process
    alive = tmp_path / f"pdserve-compiled-{os.getppid()}-abc"
    for folder in (gone, alive):
        folder.mkdir(mode=0o700)
    made = sealed_copy.private_dir()
    assert made.name.startswith(f"pdserve-compiled-{os.getpid()}-")
    assert not gone.exists() and alive.exists()


def test_a_copy_named_by_the_environment_is_never_taken_for_the_shared_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child process inherits TORCHINDUCTOR_CACHE_DIR naming its parent's private copy:
    its own copy comes from the shared cache, and the parent's copy is left alone (taken
    for the shared cache, its files, which carry no manifest, would have been removed)."""
    from pdserve.engine.host_tag import host_tag

    shared = tmp_path / "cache" / host_tag()
    shared.mkdir(parents=True)
    (shared / "graph.py").write_text("x = 1")
    cache_seal.seal(shared, _ring(SECRET))
    parents = tmp_path / f"{sealed_copy.PREFIX}1-abc"
    parents.mkdir()
    (parents / "graph.py").write_text("x = 1")
    monkeypatch.setenv(env.COMPILE_CACHE, str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(parents))
    monkeypatch.setenv(env.SERVICE_SECRET, SECRET)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared / "triton" / "0"))  # set before
    compiled._use_checked_copy()
    mine = compiled.cache_dir()
    assert mine != parents and compiled._copies[mine][0] == shared
    assert "TRITON_CACHE_DIR" not in os.environ  # inductor sets it again under the copy
    assert (mine / "graph.py").read_text() == "x = 1"
    assert (parents / "graph.py").exists()
