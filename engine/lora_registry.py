"""Multi-LoRA: the adapters a worker knows, keeps in host memory and has on the device.

Three tiers, each bounded:

- known: name → directory (``--lora NAME=PATH``, ``POST /v1/load_lora_adapter``);
- host: up to ``--max-cpu-loras`` adapters' weights in memory, least recently used out
  (a request holds its own adapter's weights while it runs, whatever the LRU drops);
- device: ``--max-loras`` slots (1..N; 0 is the base model) stacked into the wrapped
  layers (engine/lora_layers.py); a step's adapters are made resident before it runs,
  evicting the least recently used slot the step does not need.

``adapter_hash`` (engine/lora_files.py) is the adapter's identity: the request's KV is
keyed by it (hashing.salt_root's ``extra_key``) and the KV handle carries it.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from pdserve.engine import lora_layers
from pdserve.engine.lora_files import (
    NOT_AN_ADAPTER,
    PROJECTIONS,
    WEIGHTS_FILE,
    LoraConfig,
    LoraError,
    LoraSpec,
    adapter_hash,
    allowed_path,
    read_spec,
)
from pdserve.protocol.contract import LoraRef, valid_lora_name
from pdserve.protocol.sampling_params import InvalidParameter

__all__ = ["LoraAdapter", "LoraConfig", "LoraError", "LoraRegistry", "adapter_hash"]
logger = logging.getLogger(__name__)

# base_model.model.<module path>.lora_A[.<adapter>].weight, as PEFT saves it
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
LORA_MISMATCH = "lora"  # the field of a refusal the worker answers with code lora_mismatch


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: its checked spec and, per targeted layer, (A [r, in], B [out, r])
    in the model's dtype, on the host."""

    spec: LoraSpec
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def ref(self) -> LoraRef:
        return LoraRef(self.spec.name, self.spec.hash)


def _read_pairs(spec: LoraSpec) -> dict[str, dict[str, torch.Tensor]]:
    """Each LoRA layer's {"A": ..., "B": ...} as the file holds them."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(f"{spec.path}/{WEIGHTS_FILE}", framework="pt") as f:  # type: ignore[no-untyped-call]
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            m = _KEY.match(key)
            if m is None:
                raise LoraError(
                    f"adapter {spec.name!r}: weight {key!r} is not a LoRA A/B weight "
                    "(embeddings, magnitudes, biases are not supported)"
                )
            pairs.setdefault(m["path"], {})[m["ab"]] = f.get_tensor(key)
    return pairs


def load_adapter(
    spec: LoraSpec, layers: Callable[[str], tuple[int, int] | None], dtype: torch.dtype
) -> LoraAdapter:
    """Read and check the weights; ``layers(path)``: the (in, out) of a layer the model
    has and LoRA may target, None otherwise."""
    try:
        pairs = _read_pairs(spec)
    except LoraError:
        raise
    except Exception as exc:  # safetensors' own error for a file that is not one
        raise LoraError(
            f"adapter {spec.name!r}: {WEIGHTS_FILE} could not be read: {type(exc).__name__}: {exc}"
        ) from exc
    if not pairs:
        raise LoraError(f"adapter {spec.name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for path, ab in sorted(pairs.items()):
        shape = layers(path)
        if shape is None:
            raise LoraError(
                f"adapter {spec.name!r}: this model has no LoRA-capable layer "
                f"{path!r} (targets: {', '.join(PROJECTIONS)})"
            )
        a, b = ab.get("A"), ab.get("B")
        n_in, n_out = shape
        if a is None or b is None:
            raise LoraError(f"adapter {spec.name!r}: {path} lacks lora_A or lora_B")
        if tuple(a.shape) != (spec.rank, n_in) or tuple(b.shape) != (n_out, spec.rank):
            raise LoraError(
                f"adapter {spec.name!r}: {path} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"expected ({spec.rank}, {n_in}) and ({n_out}, {spec.rank})"
            )
        weights[path] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoraAdapter(spec, weights)


class LoraRegistry:
    """Known, host and device adapters of one engine (engine thread only)."""

    def __init__(
        self, model: torch.nn.Module, config: LoraConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.known: dict[str, str] = {}
        self._current: dict[str, LoraSpec] = {}  # the spec each known name serves now
        # Each name's weights while anything holds them (a slot, a running request): the
        # host LRU dropping them must not make a second copy for the next request.
        self._alive: weakref.WeakValueDictionary[str, LoraAdapter] = weakref.WeakValueDictionary()
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.slots: list[LoraAdapter | None] = [None] * config.max_loras  # slot i + 1
        self._slot_use: list[int] = [0] * config.max_loras  # a clock, for the LRU
        self._clock = 0
        self.step = lora_layers.LoraStep()
        self.wrapped: dict[str, lora_layers.LoraLinear] = {}
        self.on_first_wrap: Callable[[], None] | None = None  # the runner goes eager
        self.loads = 0  # adapters read from disk (tests, metrics)
        for name, path in config.loras:
            self.load(name, path)

    # -- known and host ----------------------------------------------------------
    def load(self, name: str, path: str) -> LoraSpec:
        """Check and load the adapter at ``path`` as ``name`` (replacing one of that name);
        LoraError naming what is wrong. Running requests keep the weights they started with."""
        if not valid_lora_name(name):
            raise LoraError("lora_name must be printable, 1 to 256 characters", "lora_name")
        adapter = self._read(name, path)
        self.unload(name, missing_ok=True)
        self.known[name] = path
        self._keep(adapter)
        return adapter.spec

    def _keep(self, adapter: LoraAdapter) -> None:
        name = adapter.spec.name
        self.host[name], self._current[name], self._alive[name] = adapter, adapter.spec, adapter
        self.host.move_to_end(name)
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)

    def unload(self, name: str, missing_ok: bool = False) -> bool:
        if name not in self.known:
            if missing_ok:
                return False
            raise KeyError(name)
        del self.known[name], self._current[name]
        self.host.pop(name, None)
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.spec.name == name:
                self.slots[i] = None
                self._restack()
        return True

    def resolve(self, ref: LoraRef) -> LoraAdapter:
        """The adapter a request names, in host memory; InvalidParameter field ``lora``
        (code lora_mismatch) if unknown here or if its hash is not this one's."""
        adapter = self.host.get(ref.name)
        if adapter is None:
            path = self.known.get(ref.name)
            if path is None:
                raise InvalidParameter(
                    LORA_MISMATCH, f"LoRA adapter {ref.name!r} is not loaded on this worker"
                )
            # Dropped by the host LRU: still held (by a slot or a request), else read again.
            adapter = self._alive.get(ref.name)
            if adapter is None or adapter.spec is not self._current[ref.name]:
                try:
                    adapter = self._read(ref.name, path)
                except (LoraError, OSError) as exc:  # the directory changed since its load
                    raise InvalidParameter(
                        LORA_MISMATCH, f"LoRA adapter {ref.name!r} could not be read again: {exc}"
                    ) from exc
            self._keep(adapter)
        self.host.move_to_end(ref.name)
        if ref.hash is not None and ref.hash != adapter.spec.hash:
            raise InvalidParameter(
                LORA_MISMATCH,
                f"LoRA adapter {ref.name!r} here has hash "
                f"{adapter.spec.hash}, the request's is {ref.hash}",
            )
        return adapter

    @property
    def resident(self) -> list[str]:
        """Adapters in memory now (host or device): served without reading a file."""
        return sorted({*self.host, *(s.spec.name for s in self.slots if s is not None)})

    def _read(self, name: str, path: str) -> LoraAdapter:
        spec = read_spec(name, path, self.config.max_lora_rank)
        adapter = load_adapter(spec, self._layer_shape, self.dtype)
        self.loads += 1
        return adapter

    def _layer_shape(self, path: str) -> tuple[int, int] | None:
        if path.rsplit(".", 1)[-1] not in PROJECTIONS:
            return None
        try:
            layer = self.model.get_submodule(path)
        except AttributeError:
            return None
        if isinstance(layer, lora_layers.LoraLinear):
            layer = layer.base
        n_in, n_out = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
        return (n_in, n_out) if isinstance(n_in, int) and isinstance(n_out, int) else None

    # -- device slots ------------------------------------------------------------
    def num_missing(self, adapters: Sequence[LoraAdapter | None]) -> int:
        """How many of ``adapters`` are not in a slot now."""
        ids = {id(a) for a in adapters if a is not None}
        return len(ids - {id(s) for s in self.slots if s is not None})

    def slots_for(self, adapters: Sequence[LoraAdapter]) -> dict[int, int]:
        """Make ``adapters`` (at most max_loras distinct) resident; id(adapter) → slot."""
        distinct = list({id(a): a for a in adapters}.values())
        assert len(distinct) <= self.config.max_loras, "a step takes at most max_loras adapters"
        self._clock += 1
        placed: dict[int, int] = {}
        missing = []
        for adapter in distinct:
            i = next((i for i, s in enumerate(self.slots) if s is adapter), None)
            if i is None:
                missing.append(adapter)
            else:
                placed[id(adapter)] = i + 1
                self._slot_use[i] = self._clock
        for adapter in missing:  # a free slot, else the least recently used one not needed now
            i = min(
                (i for i in range(len(self.slots)) if self._slot_use[i] < self._clock),
                key=lambda i: (self.slots[i] is not None, self._slot_use[i]),
            )
            self.slots[i], self._slot_use[i] = adapter, self._clock
            placed[id(adapter)] = i + 1
        if missing:
            self._restack()
        return placed

    def _restack(self) -> None:
        """Rebuild every wrapped layer's stacked A/B and the column → slot map."""
        resident = [(i + 1, a) for i, a in enumerate(self.slots) if a is not None]
        for adapter in (a for _, a in resident):
            self._wrap(adapter)
        col_slot: list[int] = []
        col_scale: list[float] = []
        for slot, adapter in resident:
            col_slot += [slot] * adapter.spec.rank
            col_scale += [adapter.spec.scaling] * adapter.spec.rank
        dev = self.device
        self.step.col_slot = torch.tensor(col_slot, dtype=torch.long, device=dev)
        self.step.col_scale = torch.tensor(col_scale, dtype=self.dtype, device=dev)
        for path, layer in self.wrapped.items():
            if not any(path in a.weights for _, a in resident):
                layer.lora_a = layer.lora_b = None
                continue
            a_parts, b_parts = [], []
            for _, adapter in resident:
                r = adapter.spec.rank
                a, b = adapter.weights.get(path, (None, None))
                a_parts.append(a if a is not None else torch.zeros(r, layer.in_features))
                b_parts.append(b if b is not None else torch.zeros(layer.out_features, r))
            layer.lora_a = torch.cat([p.to(self.dtype) for p in a_parts]).to(dev)
            layer.lora_b = torch.cat([p.to(self.dtype) for p in b_parts], dim=1).to(dev)

    def _wrap(self, adapter: LoraAdapter) -> None:
        for path in adapter.weights:
            if path not in self.wrapped:
                if not self.wrapped and self.on_first_wrap is not None:
                    self.on_first_wrap()
                self.wrapped[path] = lora_layers.wrap(self.model, path, self.step)


def check_handle(adapter: LoraAdapter | None, handle_lora: LoraRef | None) -> None:
    """A KV handle's adapter must be the request's, with this worker's hash: KV computed
    under other weights is never decoded here (InvalidParameter ``lora``)."""
    mine = None if adapter is None else adapter.ref
    if handle_lora != mine:
        raise InvalidParameter(
            LORA_MISMATCH,
            f"the KV handle was computed under LoRA {handle_lora}, this request runs under {mine}",
        )


def lora_passes(adapters: Sequence[LoraAdapter | None], max_loras: int) -> list[list[int]]:
    """Indices of a step's chunks in passes of at most ``max_loras`` distinct adapters
    each (``adapters``: each chunk's, None for the base model). Nearly always one pass:
    only a step whose running requests use more adapters than there are slots needs more."""
    passes: list[list[int]] = []
    held: list[set[int]] = []
    for i, adapter in enumerate(adapters):
        key = None if adapter is None else id(adapter)
        for members, ids in zip(passes, held, strict=True):
            if key is None or key in ids or len(ids) < max_loras:
                members.append(i)
                if key is not None:
                    ids.add(key)
                break
        else:
            passes.append([i])
            held.append(set() if key is None else {key})
    return passes


def lora_queries(registry: LoraRegistry | None) -> dict[str, Callable[..., Any]]:
    """The engine core's answers to the workers' LoRA endpoints (worker/lora_api.py):
    ``lora_load(name, path)`` → {"name", "hash"} or {"error", "field"};
    ``lora_unload(name)`` → whether it was known."""

    def load(name: str, path: str) -> dict[str, str]:
        if registry is None:
            return {"error": "this engine runs without LoRA", "field": "lora_name"}
        try:  # only under --lora-root; never a message that tells which paths exist
            spec = registry.load(name, allowed_path(path, registry.config.load_roots()))
        except LoraError as exc:
            return {"error": str(exc), "field": exc.field}
        except OSError:  # unreadable files
            return {"error": NOT_AN_ADAPTER, "field": "lora_path"}
        return {"name": spec.name, "hash": spec.hash}

    def unload(name: str) -> bool:
        return registry is not None and registry.unload(name, missing_ok=True)

    return {"lora_load": load, "lora_unload": unload}
