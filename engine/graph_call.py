"""The compiled forward's graphs called directly, without the layers around them.

A compiled step goes through ``torch.compile``'s wrapper (dynamo's frame evaluation and
guards), ``nn.Module.__call__``, transformers' decorators, the bytecode dynamo wrote
for the forward (it gathers the parameters and the norms' epsilons as the graph's inputs
and wraps the logits in a ``CausalLMOutputWithPast``), AOTAutograd's runtime wrappers,
and only then inductor's graph (``CompiledFxGraph``, whose C++ wrapper runs the step's
kernels). On the tiny preset those layers were ~0.4 ms of a ~4-5 ms decode step at 16
rows (docs/performance.md).

Once the compiled forward serves (``compiled.in_service``), :class:`DirectCalls` watches
the first calls of each graph variant: the call runs the usual way while a spy on
``CompiledFxGraph.__call__`` records the one graph it reaches, the inputs that graph
gets and what it returns. From those it builds the variant's argument template: each
input is this step's ``input_ids``, ``position_ids`` or sampled rows, a size of one of
them (an int placed just before the tensor it sizes), or a constant (a parameter, a
buffer, a scalar the bytecode rebuilt each call). A variant is proven, and from then
on called directly with that template, when two calls took the same graph with the
same constants (the same objects, or scalars of equal value), every size matched, and
the logits the forward returned were one of the graph's outputs, unchanged, and each
size took two values among the recorded calls (more calls are recorded until it has).
Anything else (a graph break, a second graph, logits rebuilt outside the graph, a
constant that changes) and that variant keeps the usual path for good.

Which variant a step takes is what the warm-up told apart (compiled.WARM_UP, and the
guards ``skip_guard_eval_unsafe`` keeps): whether the step has one token and whether it
samples one row. That key, and the constants reused as they were, are safe for the same
reason the trimmed guards are: nothing a full guard check would catch (weights, dtypes,
the module) changes while a worker serves, and LoRA adapters make the runner eager.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve import env

logger = logging.getLogger(__name__)
Key = tuple[bool, bool]  # (one token in the step, one row sampled)
IDS, POSITIONS, ROWS = 0, 1, 2  # the step's three inputs, by index
CONFIRMATIONS = 2  # usual calls that must agree before a variant is called directly
# False (PDSERVE_GRAPH_CALLS=0): every step takes the usual path (for A/B measurements)
ENABLED = env.get(env.GRAPH_CALLS, "1") != "0"

_capture_lock = threading.Lock()
_recording: dict[int, list[tuple[Any, list[Any], Any]]] = {}  # thread id -> graph calls


@dataclass
class Slot:
    """One graph input: a step input (``kind`` "input", ``index`` IDS/POSITIONS/ROWS), a
    size of one (``kind`` "size", its ``index`` and ``dim``), or a ``constant``."""

    kind: str
    index: int = -1
    dim: int = 0
    constant: Any = None
    values: set[int] = field(default_factory=set)  # a size's values in the recorded calls


@dataclass
class Variant:
    graph: Any  # torch._inductor.output_code.CompiledFxGraph
    slots: list[Slot]
    output: int  # which of the graph's outputs is the logits

    def sizes_varied(self) -> bool:
        """Every size input took two values in the recorded calls: an int that only
        happened to equal a size cannot pass for one."""
        return all(len(s.values) >= 2 for s in self.slots if s.kind == "size")

    def call(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        args: list[Any] = []
        for slot in self.slots:
            if slot.kind == "input":
                args.append(inputs[slot.index])
            elif slot.kind == "size":
                args.append(inputs[slot.index].shape[slot.dim])
            else:
                args.append(slot.constant)
        return self.graph(args)[self.output]  # the graph clears ``args`` (boxed call)


class DirectCalls:
    """Per compiled forward: its proven variants, by :data:`Key` (module docstring)."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward  # the compiled forward (torch.compile's wrapper)
        self.variants: dict[Key, Variant] = {}
        self.pending: dict[Key, tuple[Variant, int]] = {}  # learnt, agreed this many times
        self.refused: dict[Key, str] = {}  # variant -> why it keeps the usual path
        self.direct_calls = 0

    def run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The step's logits, [1, rows, vocab]: ``forward(...).logits``, called directly
        once the step's variant is proven."""
        key = (input_ids.shape[-1] == 1, rows.shape[0] == 1)
        inputs = (input_ids, position_ids, rows)
        variant = self.variants.get(key)
        if variant is not None:
            self.direct_calls += 1
            return variant.call(inputs)
        pending = self.pending.get(key)
        if key in self.refused or (pending is not None and _nothing_new(pending, inputs)):
            return _forward(self.forward, inputs).logits
        logits, calls = _recorded(self.forward, inputs)
        self._learn(key, inputs, logits, calls)
        return logits

    def _refuse(self, key: Key, why: str) -> None:
        self.refused[key] = why
        logger.info("compiled graph variant %s keeps torch.compile's wrapper: %s", _name(key), why)

    def _learn(
        self,
        key: Key,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        logits: torch.Tensor,
        calls: list[tuple[Any, list[Any], Any]],
    ) -> None:
        if len(calls) != 1:
            self._refuse(key, f"{len(calls)} graph calls in one forward")
            return
        graph, args, outputs = calls[0]
        seen = learn(graph, args, outputs, inputs, logits)
        if isinstance(seen, str):
            self._refuse(key, seen)
            return
        before = self.pending.get(key)
        if before is None:
            agreed = 1
        else:
            why = disagreement(before[0], seen)
            if why:
                self.pending.pop(key)
                self._refuse(key, why)
                return
            for mine, new in zip(before[0].slots, seen.slots, strict=True):
                mine.values |= new.values
            seen, agreed = before[0], before[1] + 1
        if agreed >= CONFIRMATIONS and seen.sizes_varied():
            self.pending.pop(key, None)
            self.variants[key] = seen
            logger.info("compiled graph variant %s: called directly from now on", _name(key))
        else:
            self.pending[key] = (seen, agreed)


def _nothing_new(pending: tuple[Variant, int], inputs: tuple[torch.Tensor, ...]) -> bool:
    """Agreed often enough, and this step's sizes were all seen already: recording it (a
    spy installed, ~0.2 ms) would not tell more (a steady batch of one size)."""
    variant, agreed = pending
    sizes = [s for s in variant.slots if s.kind == "size"]
    return agreed >= CONFIRMATIONS and all(inputs[s.index].shape[s.dim] in s.values for s in sizes)


def _name(key: Key) -> str:
    return {(True, True): "one decode", (False, True): "one row sampled"}.get(key, "several rows")


def _forward(forward: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
    ids, positions, rows = inputs
    return forward(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=rows)


def _recorded(
    forward: Any, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, list[tuple[Any, list[Any], Any]]]:
    """The usual call, with every graph call this thread makes during it recorded."""
    from torch._inductor.output_code import CompiledFxGraph

    me = threading.get_ident()
    calls: list[tuple[Any, list[Any], Any]] = []
    with _capture_lock:
        original = CompiledFxGraph.__call__

        def spy(graph: Any, args: Any) -> Any:
            mine = _recording.get(threading.get_ident())
            if mine is None:
                return original(graph, args)
            kept = list(args)  # the graph clears its argument list
            out = original(graph, args)
            mine.append((graph, kept, out))
            return out

        CompiledFxGraph.__call__ = spy  # type: ignore[method-assign,assignment]
        _recording[me] = calls
        try:
            logits = _forward(forward, inputs).logits
        finally:
            del _recording[me]
            CompiledFxGraph.__call__ = original  # type: ignore[method-assign]
    return logits, calls


def learn(
    graph: Any,
    args: list[Any],
    outputs: Any,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    logits: torch.Tensor,
) -> Variant | str:
    """The variant one recorded graph call shows, or why it cannot be called directly."""
    if not isinstance(outputs, (list, tuple)):
        return "the graph returned no list"
    found = [i for i, out in enumerate(outputs) if out is logits]
    if len(found) != 1:
        return "the logits are not one of the graph's outputs"
    slots: list[Slot] = []
    for i, arg in enumerate(args):
        which = next((k for k, t in enumerate(inputs) if arg is t), None)
        if which is not None:
            slots.append(Slot("input", which))
        elif type(arg) is int:
            nxt = args[i + 1] if i + 1 < len(args) else None
            owner = next((k for k, t in enumerate(inputs) if nxt is t), None)
            if owner is None:
                return f"input {i}: an int that sizes no step input"
            shape = inputs[owner].shape
            dims = [d for d in range(len(shape)) if shape[d] == arg and shape[d] > 1]
            if len(dims) != 1:
                return f"input {i}: an int that is not one size of the step input after it"
            slots.append(Slot("size", owner, dims[0], values={arg}))
        elif isinstance(arg, torch.Tensor) or arg is None or isinstance(arg, (float, bool)):
            slots.append(Slot("constant", constant=arg))
        else:
            return f"input {i}: a {type(arg).__name__}"
    return Variant(graph, slots, found[0])


def disagreement(first: Variant, second: Variant) -> str:
    """Why two recorded calls of one variant differ ("" when they agree)."""
    if first.graph is not second.graph:
        return "two calls reached different graphs"
    if first.output != second.output or len(first.slots) != len(second.slots):
        return "two calls' graph inputs differ"
    for i, (a, b) in enumerate(zip(first.slots, second.slots, strict=True)):
        if (a.kind, a.index, a.dim) != (b.kind, b.index, b.dim):
            return f"input {i} changed its role between calls"
        if a.kind == "constant" and not _same_constant(a.constant, b.constant):
            return f"input {i} changed between calls"
    return ""


def _same_constant(a: Any, b: Any) -> bool:
    """The same object, or a scalar tensor the bytecode rebuilt with the same value."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        scalar = a.dim() == 0 and b.dim() == 0 and not a.requires_grad
        return scalar and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b and not isinstance(a, torch.Tensor)
