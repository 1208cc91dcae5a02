"""Issue 44's in-process engine probes, each a count whose goal is 0: the engine tests hold
each to 0 and bench/chaos_isolation.py reports them (against the code as it is).

- ``symlink_probe``: links planted in a compile cache left after verify + seal
  (tests/engine/test_cache_seal.py; ``cache_symlink_followed``);
- ``abandoned_probe``: grammar compile threads past the bound
  (tests/engine/test_grammar_bounds.py; ``abandoned_compiles_over_bound``);
- ``lora_path_probe``: run-time LoRA loads outside ``--lora-root``, and errors that tell an
  existing path from a missing one (tests/engine/test_lora_files.py; ``lora_path_escapes``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from pdserve import keys
from pdserve.engine import cache_seal
from pdserve.engine.compile_guard import DEFAULT_BOUND
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

COMPILE_SECRET = "service-a-secret"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def symlink_probe(tmp_path: Path, secret: str = COMPILE_SECRET) -> int:
    """How many planted links a verify + seal leaves for the loader to follow (issue 44):
    a linked directory (os.walk lists it but never enters it, inductor follows it), a
    linked file, a link in a subfolder. bench/chaos.py reports it as cache_symlink_followed."""
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    (cache / "ab").mkdir(parents=True)
    outside.mkdir()
    (outside / "entry").write_bytes(b"their graph")
    (cache / "fxgraph").symlink_to(outside, target_is_directory=True)
    (cache / "kernel.so").symlink_to(outside / "entry")
    (cache / "ab" / "x.py").symlink_to(outside / "entry")
    ring = keys.KeyRing(keys.COMPILE_CACHE, (secret,))
    cache_seal.verify(cache, ring)
    cache_seal.seal(cache, ring)
    left = [p for p in ("fxgraph", "kernel.so", "ab/x.py") if os.path.lexists(cache / p)]
    assert (outside / "entry").read_bytes() == b"their graph"  # the target is not ours
    return len(left)


def core_messages(reader: Any) -> list[Any]:
    """Everything the core loop has sent to ``reader`` so far (a zmq PAIR socket)."""
    out = []
    while reader.poll(50):
        out.append(pickle.loads(reader.recv()))
    return out


def grammar_add(rid: str, salt: str | None = None) -> tuple[Any, ...]:
    """The core loop's ``add`` command for a request whose JSON schema is its own (each
    compiles), under the key salt ``salt``."""
    schema = {**SCHEMA, "title": rid}  # distinct per request: each one compiles
    params = SamplingParams(
        max_tokens=8,
        structured={"type": "json_schema", "schema": schema, "param": "response_format"},
    )
    return ("add", rid, [5, 6, 7], params, {"cache_salt": salt})


def _grammar_threads() -> int:
    return sum(t.name.startswith("pdserve-grammar") for t in threading.enumerate())


def abandoned_probe(core: Any, reader: Any, engine: LLMEngine, keys: int = 4) -> int:
    """Compiles abandoned past the bound (bench/chaos.py: abandoned_compiles_over_bound):
    ``keys`` keys each send two grammars that never finish in time (each compile is held
    until the end); the threads still compiling are counted at the worst moment. Before
    the fix every timeout left a thread behind and the next compile took a fresh one."""
    core.compile_timeout_s = 0.2
    base, worst = _grammar_threads(), 0
    for k in range(keys):
        for i in range(2):
            core._command(grammar_add(f"k{k}-{i}", f"k:{k}|r:x"))
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                core._add_compiled()
                worst = max(worst, _grammar_threads() - base)
                time.sleep(0.01)
    core_messages(reader)
    # abandoned ones + the one running (the fresh thread starts only with a compile)
    return max(0, worst - (DEFAULT_BOUND + 1))


def lora_path_probe(adapter: Path, hf_model: Any, tmp_path: Path) -> tuple[int, int]:
    """(escapes, revealing errors): run-time loads outside ``--lora-root`` that the worker
    took, and errors that differ between a path that exists and one that does not.
    bench/chaos.py reports the sum as lora_path_escapes."""
    import torch

    from pdserve.engine.lora_files import LoraConfig
    from pdserve.engine.lora_registry import LoraRegistry, lora_queries

    root = tmp_path / "root"
    inside = Path(shutil.copytree(adapter, root / "ok"))
    (root / "link").symlink_to(adapter)  # a link inside the root to a directory outside
    config = LoraConfig(max_lora_rank=16, roots=(str(root),))
    load = lora_queries(LoraRegistry(hf_model, config, torch.device("cpu"), torch.float32))[
        "lora_load"
    ]
    assert "hash" in load("ok", str(inside))
    outside = [
        str(adapter),
        f"{root}/../{adapter.relative_to(tmp_path)}",
        str(root / "link"),
        "/etc",
        str(root),
    ]
    escapes = sum("hash" in load(f"x{i}", p) for i, p in enumerate(outside))
    errors = {
        load("y", p)["error"]
        for p in ("/etc", "/nonexistent", "/etc/passwd", str(root / "missing"))
    }
    return escapes, len(errors) - 1
