"""Which models the engine serves, and each layer's attention options: never silently wrong.

transformers runs the model's code and calls the engine's attention for every layer.
The engine honours what it knows how to honour, per layer, resolved once at load:

* a sliding window (a query at position i sees keys j with ``i - j < window``), from
  ``layer_types`` + ``sliding_window`` (Gemma 2/3, gpt-oss, Qwen2/3) or, without
  ``layer_types``, from ``sliding_window`` on every layer (Mistral, Mixtral, Phi-3,
  Starcoder2, Qwen3-MoE), exactly the mask transformers itself builds;
* logit soft-capping (``scores = cap * tanh(scores / cap)`` before the mask; Gemma 2);
* attention sinks (gpt-oss: one learned logit per head joins each softmax, its value 0);
* the scale the model passes (``query_pre_attn_scalar``, Granite's multiplier...);
* K and V of different head sizes (MLA): V is padded with zeros to K's size in the pool.

Everything else is refused, by name: at load from the config (:func:`check_config`,
:func:`check_model`) and at every attention call (:func:`check_call`) for options the
model code passes that the engine does not implement, so an unknown option fails the
first step (the warm-up) instead of producing wrong tokens.

:func:`check_config`'s per-layer options are the config's *reading*; what is served is
what the model's code applies (``attention_probe.probe`` resolves it at load from the
first call and the mask, and compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SLIDING, FULL = "sliding_attention", "full_attention"
# Passed to the attention function by the model code, with no effect on its result.
IGNORED_KWARGS = frozenset(
    {"position_ids", "use_cache", "output_router_logits", "cache_position", "output_attentions"}
)


class UnsupportedModel(ValueError):
    """The model uses an attention option the engine does not implement."""

    def __init__(self, architecture: str, option: str, detail: str = "") -> None:
        self.architecture, self.option = architecture, option
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"{architecture} uses {option}, which pdserve's paged attention does not "
            f"implement{extra}; the model is refused rather than served wrong (docs/models.md)"
        )


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention options, resolved at load. Every attention back-end (the
    CPU kernel, the gather path, the Triton kernels) honours all of them, or the model
    is refused; ``scaling`` comes with each call."""

    window: int | None = None  # sliding window: query i sees keys j with i - j < window
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    sinks: bool = False  # a per-head learned logit (the call's s_aux) joins the softmax
    # The scale the code passed on its first call (None: head_dim ** -0.5); each call's
    # own is used, this is what the load-time probe saw (attention_probe.py).
    scaling: float | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and not self.sinks


PLAIN = LayerAttention()


def architecture(config: Any) -> str:
    names = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    return str(names[0])


def check_config(config: Any) -> tuple[LayerAttention, ...]:
    """Refuses options the engine does not implement; returns each layer's options."""
    arch = architecture(config)
    refusals = {
        "encoder-decoder": getattr(config, "is_encoder_decoder", False),
        "cross-attention": getattr(config, "add_cross_attention", False),
        "non-causal (bidirectional) attention": getattr(
            config, "use_bidirectional_attention", False
        ),
        "ALiBi position biases": getattr(config, "alibi", False)
        or getattr(config, "model_type", "") in {"bloom", "mpt"}
        or getattr(config, "position_embedding_type", None) == "alibi",
        "chunked local attention (attention_chunk_size)": getattr(
            config, "attention_chunk_size", None
        ),
    }
    for option, present in refusals.items():
        if present:
            raise UnsupportedModel(arch, option)
    return tuple(_layer(config, arch, i) for i in range(config.num_hidden_layers))


def _layer(config: Any, arch: str, i: int) -> LayerAttention:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and getattr(config, "model_type", "") not in {"mistral", "mixtral"}:
        kind = layer_types[i]
        if kind not in (SLIDING, FULL):
            raise UnsupportedModel(arch, f"layer type {kind!r}", f"layer {i}")
        window = window if kind == SLIDING else None
    return LayerAttention(
        window=int(window) if window else None,
        softcap=_float_or_none(getattr(config, "attn_logit_softcapping", None)),
        sinks=getattr(config, "model_type", "") == "gpt_oss",
    )


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


def check_model(model: torch.nn.Module, layers: tuple[LayerAttention, ...]) -> None:
    """The loaded model's attention modules: causal, one per layer, indexed."""
    arch = architecture(model.config)
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModel(arch, "attention outside transformers' AttentionInterface")
    seen = set()
    for name, module in model.named_modules():
        if not hasattr(module, "is_causal") or not hasattr(module, "layer_idx"):
            continue
        if not module.is_causal:
            raise UnsupportedModel(arch, "non-causal attention", name)
        seen.add(int(module.layer_idx))
    if seen != set(range(len(layers))):
        raise UnsupportedModel(arch, "layers without attention (hybrid model)")


def head_dims(config: Any) -> tuple[int, int]:
    """(K head size, V head size); unequal under MLA (DeepSeek-V2/V3)."""
    qk = getattr(config, "qk_head_dim", None)
    if qk is not None:
        return int(qk), int(getattr(config, "v_head_dim", None) or qk)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(d), int(d)


def check_call(
    architecture_name: str, layer_idx: int, layer: LayerAttention, kwargs: dict[str, Any]
) -> None:
    """The options one attention call passes agree with the layer's resolved options;
    any other option that is set is refused by name."""
    for name, value in kwargs.items():
        if name in IGNORED_KWARGS or value is None:
            continue
        if name == "sliding_window":
            ok = value == layer.window
        elif name == "softcap":
            ok = layer.softcap is not None and float(value) == layer.softcap
        elif name == "s_aux":
            ok = layer.sinks
        elif name == "is_causal":
            ok = bool(value)
        elif name == "dropout":
            ok = float(value) == 0.0
        else:
            ok = False
        if not ok:
            raise UnsupportedModel(
                architecture_name,
                f"attention option {name}={_show(value)}",
                f"layer {layer_idx} resolved as {layer}",
            )
    if layer.sinks and kwargs.get("s_aux") is None:
        raise UnsupportedModel(architecture_name, "sinks without s_aux", f"layer {layer_idx}")


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)
