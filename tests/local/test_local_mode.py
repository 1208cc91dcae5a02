"""Process management of ``pdserve up``: groups stopped whole, early deaths reported.

Stand-in processes (small Python one-liners) replace the workers here, because
these tests are about process groups, not serving; the end-to-end test of
``pdserve up`` with real workers is in test_e2e.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pdserve.local.proc_group import poll_until
from pdserve.local.processes import (
    ClusterSpec,
    LocalCluster,
    Proc,
    decoder_params,
    pick_base_port,
)
from pdserve.local.up import router_args
from pdserve.router.main import add_arguments as router_add_arguments

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]

# A leader that starts a grandchild and then sleeps, ignoring nothing: SIGTERM ends it,
# but the grandchild survives unless the whole group is signalled.
SPAWNER = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_stop_kills_whole_process_groups(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(model_dir=str(tmp_path), log_dir=str(tmp_path)))
    proc = Proc(
        "w", "decode", "http://127.0.0.1:1", [sys.executable, "-c", SPAWNER], tmp_path / "w.log"
    )
    cluster._spawn(proc)
    poll_until(lambda: proc.log_path.read_text().strip(), 20, 0.05, what="the spawner's pids")
    grandchild = int(proc.log_path.read_text().split()[0])
    assert proc.popen is not None and _alive(proc.popen.pid) and _alive(grandchild)
    cluster.stop(grace_s=5)
    time.sleep(0.2)
    assert not _alive(proc.popen.pid)
    assert not _alive(grandchild), "orphaned grandchild"
    cluster.stop()  # twice is harmless


def test_wait_healthy_reports_a_process_that_died(tmp_path: Path) -> None:
    cluster = LocalCluster(ClusterSpec(model_dir=str(tmp_path), log_dir=str(tmp_path)))
    argv = [sys.executable, "-c", "import sys; print('boom: bad flag'); sys.exit(3)"]
    cluster._spawn(Proc("p", "prefill", "http://127.0.0.1:1", argv, tmp_path / "p.log"))
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*boom: bad flag"):
        cluster.wait_healthy(timeout=20)
    cluster.stop()


def test_ports_are_distinct_blocks() -> None:
    taken: set[int] = set()
    a = pick_base_port("127.0.0.1", 18100, taken)
    b = pick_base_port("127.0.0.1", 18100, taken)
    assert b >= a + 10 and {a, a + 1, a + 2, b, b + 1, b + 2} <= taken


def test_router_command_line_matches_the_router_parser(tmp_path: Path) -> None:
    import argparse

    spec = ClusterSpec(model_dir=str(tmp_path), num_prefill=2, log_dir=str(tmp_path))
    cluster = LocalCluster(spec)
    cluster.procs += [
        Proc("p0", "prefill", "http://h:1", [], tmp_path / "x"),
        Proc("p1", "prefill", "http://h:2", [], tmp_path / "x"),
        Proc("d0", "decode", "http://h:3", [], tmp_path / "x"),
    ]
    ns = argparse.Namespace(
        picker="round-robin", disagg_threshold=5, api_key="k", router_arg=["--rate-limit-rpm=60"]
    )
    cluster._spawn = lambda proc: cluster.procs.append(proc)  # type: ignore[method-assign]
    router = cluster.start_router(0, args=router_args(ns))
    parser = argparse.ArgumentParser()
    router_add_arguments(parser)
    args = parser.parse_args(router.argv[4:])  # after: python -m pdserve router
    assert args.prefill == ["http://h:1", "http://h:2"] and args.decode == ["http://h:3"]
    assert (args.picker, args.disagg_threshold, args.api_key) == ("round-robin", 5, "k")
    assert args.rate_limit_rpm == 60  # --router-arg reaches the router


def _llama(path: Path, hidden: int, inter: int, layers: int) -> Path:
    """A Llama-shaped model directory whose safetensors file holds zeros: a valid header
    and a sparse file of the full size (no disk used), like the presets' shapes."""
    kv = hidden // 2  # 8 heads, 4 KV heads
    shapes = {
        "model.embed_tokens.weight": [1000, hidden],
        "lm_head.weight": [1000, hidden],
        "model.norm.weight": [hidden],
    }
    for i in range(layers):
        for name, shape in {
            "self_attn.q_proj": [hidden, hidden],
            "self_attn.k_proj": [kv, hidden],
            "self_attn.v_proj": [kv, hidden],
            "self_attn.o_proj": [hidden, hidden],
            "mlp.gate_proj": [inter, hidden],
            "mlp.up_proj": [inter, hidden],
            "mlp.down_proj": [hidden, inter],
            "input_layernorm": [hidden],
            "post_attention_layernorm": [hidden],
        }.items():
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    path.mkdir()
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def test_decoder_params_and_the_shared_cores(tmp_path: Path) -> None:
    """The lone worker's all-cores rule is measured (tests/local/test_thread_probe.py)."""
    cores = len(os.sched_getaffinity(0))
    small = _llama(tmp_path / "small", 512, 1408, 8)  # the presets' shapes
    # Every decoder matrix and norm, no embeddings and no output head.
    layer = 2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1408 + 2 * 512
    assert decoder_params(str(small)) == 8 * layer + 512
    scaled = ClusterSpec(model_dir=str(small), num_prefill=0, autoscaled=True)
    assert scaled.threads_per_worker() == max(1, cores - 1)  # more may join it
    two = ClusterSpec(model_dir=str(small), num_prefill=1, num_decode=1)
    assert two.threads_per_worker() == max(1, (cores - 1) // 2)
    assert decoder_params(str(tmp_path / "missing")) == 0
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"not a safetensors file")
    assert decoder_params(str(tmp_path / "junk")) == 0


@pytest.mark.parametrize("family_id", ["gpt-neox", "deepseek-v3", "gpt-oss"])
def test_decoder_params_of_any_architecture(family_id: str, tiny_model_dir: Path) -> None:
    """Not Llama's formula: GPT-NeoX (fused QKV, output head named embed_out), DeepSeek-V3
    (MLA projections, routed and shared experts), gpt-oss (sinks, fused experts) counted
    as transformers stores their tensors, embeddings and output head aside."""
    from transformers import AutoModelForCausalLM

    from tests.model_families import BY_ID, cached_family

    model_dir = cached_family(BY_ID[family_id], tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    stored = sum(t.numel() for t in model.state_dict().values())  # incl. saved buffers
    expected = stored - head.numel() - embed.numel()
    assert decoder_params(str(model_dir)) == expected


def test_workers_share_the_cores_and_an_explicit_worker_arg_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from pdserve.engine.engine_args import add_engine_arguments

    cores = len(os.sched_getaffinity(0))
    spec = ClusterSpec(model_dir=str(tmp_path), num_prefill=1, num_decode=1, log_dir=str(tmp_path))
    assert spec.threads_per_worker() == max(1, (cores - 1) // 2)  # a core kept for streaming
    colocated = ClusterSpec(model_dir=str(tmp_path), num_prefill=0, log_dir=str(tmp_path))
    assert colocated.threads_per_worker() == max(1, cores - 1)  # no weights: nothing to probe
    spec = ClusterSpec(
        model_dir=str(tmp_path),
        num_prefill=2,
        num_decode=3,
        cpu_threads=3,
        log_dir=str(tmp_path),
        worker_args=("--cpu-threads", "4"),
    )
    assert spec.threads_per_worker() == 3
    cluster = LocalCluster(spec)
    cluster._spawn = lambda proc: cluster.procs.append(proc)  # type: ignore[method-assign]
    worker = cluster.add_worker("decode")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args, _ = parser.parse_known_args(worker.argv[4:])  # after: python -m pdserve decode-worker
    assert args.cpu_threads == 4  # the user's --worker-arg comes last
    assert worker.argv.count("--cpu-threads") == 1  # the worker arg's alone
    # A lone worker whose thread count is named does not run the start-up probe (a child
    # process importing torch) only to have its answer overridden.
    lone = ClusterSpec(
        model_dir=str(tmp_path),
        num_prefill=0,
        log_dir=str(tmp_path),
        worker_args=("--cpu-threads=2",),
    )

    def no_probe(self: ClusterSpec) -> dict[str, object]:
        raise AssertionError("probed although --cpu-threads was given")

    monkeypatch.setattr(ClusterSpec, "lone_worker_probe", no_probe)
    cluster = LocalCluster(lone)
    cluster._spawn = lambda proc: cluster.procs.append(proc)  # type: ignore[method-assign]
    argv = cluster.add_worker("decode").argv
    assert "--cpu-threads=2" in argv and "--cpu-threads" not in argv
