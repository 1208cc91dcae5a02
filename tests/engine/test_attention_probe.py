"""Each layer's attention options follow the model's code, not its config
(engine/attention_probe.py), for every served family of tests/model_families.py:

* a config field the code ignores (``attn_logit_softcapping`` where the attention never
  passes ``softcap``) is not applied, although the config's own reading
  (``check_config``) would apply it; a ``sliding_window`` only the config states is
  applied where the code's mask holds it, ignored where mask and cache ignore it, and
  refused where transformers' cache would window what its mask does not;
* an option the code passes that the config does not state (a ``softcap``) is applied;
* a ``sliding_window`` the code passes that its mask does not hold, and a mask that is
  not causal or not a sliding window, are refused by name.

The models are built in-process from the family's config (no weights written); the
token-level proof of the same rule is the ``gemma3-config-softcap`` (served,
token-identical) and ``llama-config-window`` (refused) rows of test_model_families.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from pdserve.engine import attention_probe
from pdserve.engine.attention import ATTN_IMPLEMENTATION
from pdserve.engine.model_support import LayerAttention, UnsupportedModel, check_config
from tests.model_families import FAMILIES, Family, make_config

pytestmark = pytest.mark.unit

SERVED = [f for f in FAMILIES if f.refused is None]
IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _model(family: Family, **extra: Any) -> Any:
    from transformers import AutoModelForCausalLM

    config = make_config(family, 128, IDS)
    for name, value in extra.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    ).eval()


def _resolve(model: Any) -> tuple[LayerAttention, ...]:
    arch = type(model).__name__
    return attention_probe.probe(model, check_config(model.config), arch, torch.device("cpu"))


def _options(layers: tuple[LayerAttention, ...]) -> list[LayerAttention]:
    return [replace(layer, scaling=None) for layer in layers]


def _attention_class(model: Any) -> type:
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "is_causal"):
            return type(module)
    raise AssertionError("no attention module")


@pytest.mark.parametrize("family", SERVED, ids=[f.id for f in SERVED])
def test_a_softcap_the_code_ignores_is_not_applied(family: Family) -> None:
    baseline = _resolve(_model(family))
    if any(layer.softcap for layer in baseline):
        pytest.skip("the family's code passes its config's softcap (gemma2)")
    model = _model(family, attn_logit_softcapping=7.0)
    assert _options(_resolve(model)) == _options(baseline)
    # The config's reading (what the engine applied before the probe) soft-caps.
    assert [layer.softcap for layer in check_config(model.config)] == [7.0] * len(baseline)


# A ``sliding_window`` field on a family without a window: its code builds a windowed
# mask from the field alone (and transformers' cache keeps the window): applied; the
# field is gated off by ``layer_types`` for mask and cache alike: ignored; else the cache
# windows what the mask does not (generate() and forward disagree): refused by name.
WINDOW_APPLIED, WINDOW_IGNORED = {"qwen3-moe"}, {"qwen2", "qwen3", "qwen2-moe"}
UNWINDOWED = [f for f in SERVED if "sliding_window" not in f.kwargs]


@pytest.mark.parametrize("family", UNWINDOWED, ids=[f.id for f in UNWINDOWED])
def test_a_window_only_the_config_states(family: Family) -> None:
    baseline = _resolve(_model(family))
    assert all(layer.window is None for layer in baseline)
    model = _model(family, sliding_window=5)
    if family.id in WINDOW_APPLIED | WINDOW_IGNORED:
        window = 5 if family.id in WINDOW_APPLIED else None
        want = [replace(layer, window=window) for layer in _options(baseline)]
        assert _options(_resolve(model)) == want
        return
    # The config's reading (before the probe) applied it: served wrong, now refused.
    assert [layer.window for layer in check_config(model.config)] == [5] * len(baseline)
    with pytest.raises(UnsupportedModel, match="config sliding_window=5 that transformers' KV"):
        _resolve(model)


@pytest.mark.parametrize("family", SERVED, ids=[f.id for f in SERVED])
def test_options_the_config_hides_follow_the_code(
    family: Family, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The family's attention made to pass a ``softcap`` its config does not state."""
    model = _model(family)
    if any(layer.softcap for layer in check_config(model.config)):
        pytest.skip("the family's code passes softcap from its config (gemma2)")
    cls = _attention_class(model)
    forward = cls.forward

    def with_softcap(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, softcap=3.0, **kwargs)

    monkeypatch.setattr(cls, "forward", with_softcap)
    layers = _resolve(model)
    assert [layer.softcap for layer in layers] == [3.0] * len(layers)
    assert [layer.softcap for layer in check_config(model.config)] == [None] * len(layers)


def test_a_window_the_mask_does_not_hold_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward

    def with_window(self: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, sliding_window=5, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", with_window)
    model = _model(next(f for f in SERVED if f.id == "llama"))
    with pytest.raises(UnsupportedModel, match="sliding_window=5 with a mask of window None"):
        _resolve(model)


def _causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return kv <= q


@pytest.mark.parametrize(
    ("mask_function", "window"),
    [
        (_causal, None),
        (lambda b, h, q, kv: (kv <= q) & (kv > q - 8), 8),
        (lambda b, h, q, kv: (kv <= q) & (kv > q - 300), 300),
    ],
)
def test_mask_kind_reads_the_window(mask_function: Any, window: int | None) -> None:
    assert attention_probe.mask_kind("FooForCausalLM", mask_function, 512).window == window


@pytest.mark.parametrize(
    ("mask_function", "named"),
    [
        (lambda b, h, q, kv: q >= 0, "non-causal"),  # bidirectional
        (lambda b, h, q, kv: (kv <= q) & (kv // 8 == q // 8), "not a sliding window"),  # chunked
        (lambda b, h, q, kv: (kv <= q) & (kv % 2 == 0), "not a sliding window"),  # strided
    ],
)
def test_mask_kind_refuses_other_shapes(mask_function: Any, named: str) -> None:
    with pytest.raises(UnsupportedModel, match=f"FooForCausalLM uses .*{named}"):
        attention_probe.mask_kind("FooForCausalLM", mask_function, 512)
