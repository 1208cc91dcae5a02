"""Each layer's attention options, read from what the model's code does on its first call.

A config field is not an option: Gemma 3's config may carry ``attn_logit_softcapping``
while its attention never passes ``softcap``; a Llama config may carry ``sliding_window``
while its mask stays fully causal. transformers applies what the code passes and what the
mask holds, so the engine does the same: at load, one token runs through the model with
this module's attention and mask functions (``PROBE``), which record per layer

* the options the call passes (``sliding_window``, ``softcap``, ``s_aux``, ``scaling``;
  any other set option is refused by name, as at every later call: ``check_call``);
* the mask the model built for the layer, read from the mask *function* transformers
  hands its mask interface: evaluated on rows up to the model's last position, it must be
  causal and a sliding window (or none), which gives the window; a chunked, bidirectional
  or otherwise shaped mask, or a layer that gets no mask from transformers, is refused.

The resolved options follow the code; a config field the code ignores (or an option the
code takes from elsewhere) is logged, never applied on the config's word. A
``sliding_window`` the call passes that disagrees with its mask is refused (transformers'
own back-ends would disagree with each other).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from pdserve.engine.model_support import LayerAttention, UnsupportedModel, check_call

logger = logging.getLogger(__name__)

PROBE = "pdserve_probe"
MAX_PROBED_POSITIONS = 1 << 20  # the mask's rows are read up to here (or the model's last)


@dataclass(frozen=True)
class MaskKind:
    window: int | None  # None: causal over the whole context


@dataclass
class _Call:
    kwargs: dict[str, Any]
    mask: MaskKind | None  # None: no mask from transformers' mask functions


@dataclass
class _Recorder(threading.local):
    calls: dict[int, _Call] = field(default_factory=dict)
    masks: dict[int, Any] = field(default_factory=dict)  # data_ptr -> mask function
    kinds: dict[int, MaskKind] = field(default_factory=dict)  # id(mask function) -> kind
    keep: list[torch.Tensor] = field(default_factory=list)  # masks alive: ptrs stay unique
    arch: str = "?"
    positions: int = 0


_REC = _Recorder()


def mask_kind(arch: str, mask_function: Any, positions: int) -> MaskKind:
    """The window of a causal sliding-window mask function (None: plain causal), read on
    rows up to ``positions``; any other shape is refused by name."""
    rows = sorted({0, 1, 2, 3, 7, 8, 9, 31, 100, 257, positions // 2 + 3, positions - 1})
    window: int | None = None
    counts = []
    for q in (r for r in rows if 0 <= r < positions):
        kv = torch.arange(positions)
        z = torch.zeros((), dtype=torch.long)
        try:
            allowed = torch.as_tensor(mask_function(z, z, torch.tensor(q), kv)).expand(positions)
        except Exception as exc:  # a mask function that needs vmap, or more than positions
            what = "an attention mask function it cannot read"
            raise UnsupportedModel(arch, what, repr(exc)) from exc
        if bool(allowed[q + 1 :].any()):
            raise UnsupportedModel(arch, "a non-causal attention mask", f"query {q}")
        n = int(allowed.sum())
        if not bool(allowed[q + 1 - n : q + 1].all()) or n == 0:
            raise UnsupportedModel(arch, "an attention mask that is not a sliding window", f"q {q}")
        counts.append((q, n))
        if n < q + 1:
            window = n if window is None else min(window, n)
    for q, n in counts:
        if n != (q + 1 if window is None else min(q + 1, window)):
            raise UnsupportedModel(
                arch, "an attention mask that is not a sliding window (chunked?)", f"query {q}"
            )
    return MaskKind(window)


def _probe_mask(*, mask_function: Any, device: Any = "cpu", **_kw: Any) -> torch.Tensor:
    # Read when a layer's call uses it: a model may build masks no layer uses.
    mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    _REC.masks[mask.data_ptr()] = mask_function
    _REC.keep.append(mask)
    return mask


def _probe_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # Every option as the call passes it (scaling and dropout by keyword, as to
    # engine/attention.py's paged_attention, with the same defaults).
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scaling = kwargs.pop("scaling", None)
    opts = {"dropout": 0.0, **kwargs}
    # Options the engine does not know are refused here, as at every later call.
    own = LayerAttention(
        window=kwargs.get("sliding_window"),  # type: ignore[arg-type]
        softcap=None if kwargs.get("softcap") is None else float(kwargs["softcap"]),  # type: ignore[arg-type]
        sinks=kwargs.get("s_aux") is not None,
    )
    check_call(_REC.arch, layer, own, opts)
    function = None if attention_mask is None else _REC.masks.get(attention_mask.data_ptr())
    mask = None
    if function is not None:
        if id(function) not in _REC.kinds:
            _REC.kinds[id(function)] = mask_kind(_REC.arch, function, _REC.positions)
        mask = _REC.kinds[id(function)]
    _REC.calls[layer] = _Call({**opts, "scaling": scaling}, mask)
    _b, hq, t, _d = query.shape
    return query.new_zeros((1, t, hq, value.shape[-1])), None


AttentionInterface.register(PROBE, _probe_attention)
AttentionMaskInterface.register(PROBE, _probe_mask)


@torch.inference_mode()
def probe(
    model: Any, configured: tuple[LayerAttention, ...], arch: str, device: torch.device
) -> tuple[LayerAttention, ...]:
    """Runs one token through ``model`` under the probe; returns each layer's options as
    the code applies them (``configured``: the config's reading, compared and logged)."""
    config = model.config
    serving = config._attn_implementation
    _REC.calls, _REC.masks, _REC.kinds, _REC.keep = {}, {}, {}, []
    positions = int(getattr(config, "max_position_embeddings", None) or 4096)
    _REC.arch, _REC.positions = arch, min(positions, MAX_PROBED_POSITIONS)
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    config._attn_implementation = PROBE
    try:
        model(input_ids=one, position_ids=one, use_cache=False, logits_to_keep=1)
        calls = dict(_REC.calls)
    finally:
        config._attn_implementation = serving
        _REC.calls, _REC.masks, _REC.kinds, _REC.keep = {}, {}, {}, []
    layers = tuple(resolve(arch, i, c, calls.get(i)) for i, c in enumerate(configured))
    for i, (layer, cached) in enumerate(zip(layers, cache_windows(config), strict=False)):
        if cached is not None and (layer.window is None or layer.window > cached):
            raise UnsupportedModel(
                arch,
                f"a config sliding_window={cached} that transformers' KV cache applies but "
                f"the model's attention mask does not (window {layer.window})",
                f"layer {i}; its generate() and its forward disagree",
            )
    return layers


def cache_windows(config: Any) -> list[int | None]:
    """The window transformers' DynamicCache keeps per layer (what ``generate()`` drops),
    read by transformers' own helper; [] where this transformers has none."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        _types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (ImportError, AttributeError):
        return []
    return [k.get("sliding_window") for k in kwargs]


def resolve(arch: str, i: int, configured: LayerAttention, call: _Call | None) -> LayerAttention:
    """Layer ``i``'s options from its first call; ``configured`` is the config's reading."""
    if call is None:
        raise UnsupportedModel(arch, "a layer whose attention was not called", f"layer {i}")
    if call.mask is None:
        raise UnsupportedModel(
            arch, "an attention mask not built by transformers' mask functions", f"layer {i}"
        )
    passed = call.kwargs.get("sliding_window")
    if passed is not None and passed != call.mask.window:
        raise UnsupportedModel(
            arch,
            f"attention option sliding_window={passed!r} with a mask of window "
            f"{call.mask.window!r}",
            f"layer {i}",
        )
    softcap = call.kwargs.get("softcap")
    scaling = call.kwargs.get("scaling")
    resolved = LayerAttention(
        window=call.mask.window,
        softcap=None if softcap is None else float(softcap),
        sinks=call.kwargs.get("s_aux") is not None,
        scaling=None if scaling is None else float(scaling),
    )
    if replace(resolved, scaling=None) != replace(configured, scaling=None):
        logger.info(
            "%s layer %d: the config reads as %s, the model's code applies %s: the code is "
            "followed, as transformers does",
            arch,
            i,
            configured,
            resolved,
        )
    return resolved
