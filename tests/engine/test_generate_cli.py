"""``pdserve generate`` on the tiny model.

The runs that load the model call the command's entry (``pdserve.cli.main``) in this
process: a child would import torch and transformers again (~5 CPU-s each). The bad
arguments refused before torch loads run as real ``python -m pdserve.cli`` children
(~0.1 CPU-s each): the console entry, its exit status and its stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import main
from pdserve.testing.hf_reference import hf_greedy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]


def _generate(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(model), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)


def _generate_here(
    capsys: pytest.CaptureFixture[str], model: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``pdserve generate`` through its entry in this process: exit status, stdout, stderr."""
    capsys.readouterr()  # what earlier fixtures printed is not the command's
    try:
        code = main(["generate", "--model", str(model), *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code if isinstance(exc.code, int) else 2
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["pdserve", "generate"], code, out.out, out.err)


def test_streams_the_greedy_completion(
    tiny_model_dir: Path, tiny_tokenizer: Any, hf_model: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "def main():\n    return"
    proc = _generate_here(
        capsys,
        tiny_model_dir,
        "--prompt",
        prompt,
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--device",
        "cpu",
    )
    assert proc.returncode == 0, proc.stderr
    ids = tiny_tokenizer(prompt)["input_ids"]
    want = tiny_tokenizer.backend_tokenizer.decode(hf_greedy(hf_model, ids, 24))
    assert proc.stdout == want + "\n"
    pattern = r"\[length\] prompt_tokens=(\d+) completion_tokens=24 .* tok/s"
    summary = re.search(pattern, proc.stderr)
    assert summary is not None, proc.stderr
    assert int(summary.group(1)) == len(ids)
    free = re.search(r"kv_blocks_free=(\d+)/(\d+)", proc.stderr)
    assert free is not None and free.group(1) == free.group(2)  # nothing leaked


def test_chat_and_sampling_flags(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--prompt", "hello", "--chat", "--temperature", "0.8", "--seed", "5"]
    proc = _generate_here(capsys, tiny_model_dir, *args, "--max-tokens", "8", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() and "completion_tokens=8" in proc.stderr
    free = re.search(r"kv_blocks_free=(\d+)/(\d+)", proc.stderr)
    assert free is not None and free.group(1) == free.group(2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "2"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--dtype", "float32", "--block-size", "3"], "block_size"),
    ],
)
def test_bad_arguments_exit_2(tiny_model_dir: Path, args: list[str], message: str) -> None:
    proc = _generate(tiny_model_dir, "--prompt", "hi", *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_max_tokens_past_the_model_exits_2(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused once the model is loaded (its length is the bound): in this process."""
    proc = _generate_here(capsys, tiny_model_dir, "--prompt", "hi", "--max-tokens", "5000")
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr and "Traceback" not in proc.stderr
