"""Adapter directories the engine cannot serve are refused at load, by name: never
served approximately. Also the adapter hash, the flags and the step's passes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.lora_files import (
    LoraConfig,
    LoraError,
    adapter_hash,
    parse_lora_flag,
    read_spec,
)
from pdserve.engine.lora_registry import LoraAdapter, LoraRegistry, lora_passes, lora_queries
from pdserve.protocol.hashing import ROOT_HASH, block_hashes, salt_root
from pdserve.testing.engine_probes import lora_path_probe
from pdserve.testing.lora_adapters import SPECS, edit_config, write_adapter

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def good(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tiny_model_dir, tmp_path_factory.mktemp("good") / "a", SPECS[0])


@pytest.fixture
def copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "copy"))


@pytest.fixture
def registry(hf_model: Any) -> LoraRegistry:
    return LoraRegistry(hf_model, LoraConfig(max_lora_rank=16), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"lora_bias": True}, "LoRA bias terms"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
        ({"alpha_pattern": {"q_proj": 4}}, "per-module alphas"),
        ({"layers_to_transform": [0]}, "layer subsets"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target 'embed_tokens'"),
        ({"target_modules": ["lm_head"]}, "target 'lm_head'"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": 32}, "rank 32 is over --max-lora-rank 16"),
        ({"r": 0}, "r must be a positive integer"),
        ({"lora_alpha": "big"}, "lora_alpha must be a number"),
    ],
)
def test_refused_configs(
    copy: Path, registry: LoraRegistry, change: dict[str, Any], message: str
) -> None:
    edit_config(copy, **change)
    with pytest.raises(LoraError, match=message):
        registry.load("x", str(copy))
    assert "x" not in registry.known


def test_bad_directories(copy: Path, registry: LoraRegistry, tmp_path: Path) -> None:
    with pytest.raises(LoraError, match="is not an adapter directory") as exc:
        registry.load("x", str(tmp_path / "nothing"))
    assert exc.value.field == "lora_path"
    (copy / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match=r"adapter_config\.json is not JSON"):
        registry.load("x", str(copy))
    (copy / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match="is not an adapter directory"):
        registry.load("x", str(copy))
    with pytest.raises(LoraError, match="lora_name") as exc:
        registry.load("", str(copy))
    assert exc.value.field == "lora_name"


def _rewrite_weights(adapter: Path, edit: Any) -> None:
    file = adapter / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_bad_weights(copy: Path, good: Path, registry: LoraRegistry) -> None:
    key = next(k for k in load_file(copy / "adapter_model.safetensors") if "lora_A" in k)
    layer = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")

    _rewrite_weights(copy, lambda t: t.update({key: torch.zeros(8, 7)}))
    with pytest.raises(LoraError, match=r"expected \(8, 128\)"):
        registry.load("x", str(copy))
    _rewrite_weights(copy, lambda t: t.pop(key))
    with pytest.raises(LoraError, match=f"{layer} lacks lora_A"):
        registry.load("x", str(copy))
    (copy / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoraError, match="could not be read"):
        registry.load("x", str(copy))
    shutil.copy(good / "adapter_model.safetensors", copy / "adapter_model.safetensors")
    emb = "base_model.model.model.embed_tokens.lora_embedding_A"
    _rewrite_weights(copy, lambda t: t.update({emb: torch.zeros(8, 3072)}))
    with pytest.raises(LoraError, match="is not a LoRA A/B weight"):
        registry.load("x", str(copy))


def test_hash_is_of_the_files(good: Path, copy: Path) -> None:
    digest = adapter_hash(good)
    assert len(digest) == 32 and digest == adapter_hash(copy)
    edit_config(copy, lora_alpha=3)
    assert adapter_hash(copy) != digest
    spec = read_spec("a", good, 64)
    assert spec.hash == digest and spec.rank == 8 and spec.scaling == 16 / 8


def test_rslora_scaling(tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = read_spec("r", write_adapter(tiny_model_dir, tmp_path / "r", SPECS[2]), 64)
    assert spec.rank == 16 and spec.scaling == pytest.approx(8.0 / 4.0)


def test_adapter_seeds_the_block_hashes() -> None:
    tokens = list(range(40))
    base = block_hashes(tokens, 16)
    under = block_hashes(tokens, 16, salt_root(None, "a" * 32))
    other = block_hashes(tokens, 16, salt_root(None, "b" * 32))
    assert len({base[0], under[0], other[0]}) == 3
    assert salt_root(None, None) == ROOT_HASH and salt_root("s") == salt_root("s", None)
    assert salt_root("s", "a" * 32) not in (salt_root("s"), salt_root(None, "a" * 32))


def test_flags_and_config() -> None:
    assert parse_lora_flag("sql=/adapters/sql") == ("sql", "/adapters/sql")
    for bad in ("sql", "=/x", "sql="):
        with pytest.raises(ValueError, match="NAME=PATH"):
            parse_lora_flag(bad)
    with pytest.raises(ValueError, match="--max-cpu-loras"):
        LoraConfig(max_loras=4, max_cpu_loras=2)


def test_passes_hold_at_most_max_loras_adapters(good: Path) -> None:
    a, b, c = (LoraAdapter(read_spec(n, good, 64), {}) for n in "abc")
    assert lora_passes([None, a, b, a, None], 2) == [[0, 1, 2, 3, 4]]
    assert lora_passes([a, b, c, None, c, a], 2) == [[0, 1, 3, 5], [2, 4]]


def test_queries_answer_errors_by_field(copy: Path, hf_model: Any) -> None:
    config = LoraConfig(max_lora_rank=16, roots=(str(copy.parent),))
    registry = LoraRegistry(hf_model, config, torch.device("cpu"), torch.float32)
    queries = lora_queries(registry)
    got = queries["lora_load"]("a", str(copy))
    assert got == {"name": "a", "hash": adapter_hash(copy)}
    assert registry.known == {"a": str(copy)}
    assert queries["lora_load"]("b", "/nonexistent")["field"] == "lora_path"
    assert queries["lora_unload"]("a") is True and queries["lora_unload"]("a") is False
    assert lora_queries(None)["lora_load"]("a", str(copy))["field"] == "lora_name"


def test_run_time_loads_stay_under_the_lora_root(good: Path, hf_model: Any, tmp_path: Path) -> None:
    """Issue 44 item 7: ``lora_path`` was any absolute path the worker could read, and
    the errors said which paths exist."""
    outside = Path(shutil.copytree(good, tmp_path / "outside"))
    assert lora_path_probe(outside, hf_model, tmp_path) == (0, 0)
    # no --lora-root and no --lora: no run-time loads at all
    bare = LoraRegistry(hf_model, LoraConfig(), torch.device("cpu"), torch.float32)
    assert lora_queries(bare)["lora_load"]("a", str(outside))["field"] == "lora_path"
    # the default root: the folders of the --lora adapters
    assert LoraConfig(loras=(("a", str(outside)),)).load_roots() == (str(tmp_path),)
