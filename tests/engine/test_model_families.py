"""Every model family of tests/model_families.py: served token-identical to transformers,
or refused at load by name (docs/models.md's table lists the same ids).

A served family's tiny random model runs through the engine on both attention paths
(the CPU kernel and the gather path), with prompts longer than its sliding window and a
prefill split into chunks, and must give transformers' own greedy tokens (eager
attention, float32). ``test_option_matters`` shows the comparison can fail: with one
layer option dropped from the engine (the guard that would refuse that disabled), the
tokens differ from transformers'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import family_matrix as fm
import pytest
import torch
from family_matrix import REFUSED, Served, generate, reference

from pdserve.engine import attention, cpu_kernel
from pdserve.engine.model_support import PLAIN, LayerAttention, UnsupportedModel
from tests.model_families import BY_ID, FAMILIES, WINDOW, Family

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]


def test_family_matches_transformers(served: Served) -> None:
    model_dir, expected = served.model_dir, served.expected
    # Random weights that move: greedy tokens change from step to step.
    assert all(len(set(e)) >= 4 for e in expected), expected
    paths = [True, False] if cpu_kernel.load() is not None else [False]
    for kernel in paths:
        engine = fm.engine(model_dir, kernel)
        assert engine.runner.use_kernel == kernel
        got = generate(engine)
        assert got == expected, f"{'kernel' if kernel else 'gather'} path: {got} != {expected}"


@pytest.mark.parametrize("family", REFUSED, ids=[f.id for f in REFUSED])
def test_family_refused(family: Family, family_dir: Callable[[Family], Path]) -> None:
    model_dir = family_dir(family)
    with pytest.raises(UnsupportedModel) as err:
        fm.engine(model_dir, kernel=True)
    assert family.refused is not None and family.refused in str(err.value)
    assert "ForCausalLM uses " in str(err.value)  # the architecture is named


@pytest.mark.parametrize(
    ("family_id", "option"),
    [("mistral", "window"), ("gemma2", "softcap"), ("gpt-oss", "sinks"), ("gemma3-text", "window")],
)
def test_option_matters(
    family_id: str,
    option: str,
    family_dir: Callable[[Family], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dropping one honoured option makes the output differ from transformers: the matrix
    above would catch an engine that ignored it (what the guard exists to prevent)."""
    model_dir = family_dir(BY_ID[family_id])
    expected = reference(model_dir)
    engine = fm.engine(model_dir, kernel=True)
    dropped = {"window": None, "softcap": None, "sinks": False}[option]
    layers = engine.runner.layers
    assert any(getattr(layer, option) not in (None, False) for layer in layers)
    engine.runner.layers = tuple(replace(layer, **{option: dropped}) for layer in layers)
    monkeypatch.setattr(attention, "check_call", lambda *a: None)
    assert generate(engine) != expected


class _Attn(torch.nn.Module):
    layer_idx = 0


def _call(layers: tuple[LayerAttention, ...], **kwargs: Any) -> None:
    q = torch.zeros(1, 4, 1, 16)
    attention.CURRENT.layers, attention.CURRENT.architecture = layers, "FooForCausalLM"
    try:
        attention.paged_attention(_Attn(), q, q[:, :2], q[:, :2], None, scaling=0.25, **kwargs)
    finally:
        attention.CURRENT.layers = ()


@pytest.mark.parametrize(
    ("layer", "kwargs", "named"),
    [
        (PLAIN, {"alibi_slopes": torch.ones(4)}, "alibi_slopes=<tensor (4,)>"),
        (PLAIN, {"sliding_window": WINDOW}, "sliding_window=8"),  # not the layer's: refused
        (LayerAttention(window=WINDOW), {"sliding_window": 4}, "sliding_window=4"),
        (PLAIN, {"softcap": 30.0}, "softcap=30.0"),
        (PLAIN, {"s_aux": torch.zeros(4)}, "s_aux="),
        (PLAIN, {"is_causal": False}, "is_causal=False"),
        (PLAIN, {"dropout": 0.1}, "dropout=0.1"),
    ],
)
def test_attention_call_refuses_what_it_does_not_honour(
    layer: LayerAttention, kwargs: dict[str, Any], named: str
) -> None:
    """The runtime guard: a call whose options the engine does not honour (or that disagree
    with the layer's resolved options) raises before any attention, naming the option."""
    with pytest.raises(UnsupportedModel, match="FooForCausalLM uses attention option") as err:
        _call((layer,), **kwargs)
    assert named in str(err.value)


def test_unknown_option_refuses_the_start(
    family_dir: Callable[[Family], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model code that passes an option the engine does not know is refused at load, by
    the one-token probe (before any request): here Llama's attention made to pass ALiBi
    slopes, as a model with ALiBi but no config flag for it would."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward

    def with_alibi(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, alibi_slopes=torch.ones(4), **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_alibi)
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM uses attention option alibi_"):
        fm.engine(family_dir(BY_ID["llama"]), kernel=True)


def test_docs_table_names_every_family() -> None:
    """docs/models.md's table has one row per family of tests/model_families.py, in its
    order, and each row names the tests that prove it: eager (E) and compiled (C) for a
    served row, the refusal (R) for a refused one (its status quoting the refusal).
    A served row also names its P/D hand-off (P): tests/engine/test_family_pd.py runs
    every served family, so no served row may be without it."""

    doc = Path(__file__).resolve().parents[2] / "docs" / "models.md"
    rows = [line for line in doc.read_text().splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        table[cells[0].strip("`")] = cells
    assert [i for i in table if i in BY_ID] == [f.id for f in FAMILIES]
    for f in FAMILIES:
        cells = table[f.id]
        if f.refused is None:
            named = [f"`E[{f.id}]`", f"`C[{f.id}]`", f"`P[{f.id}]`"]
            assert cells[3] == "served" and cells[4:7] == named, cells
        else:
            assert cells[3].startswith("refused") and cells[4] == f"`R[{f.id}]`", cells
