"""The compiled forward's graphs called directly (engine/graph_call.py): what a recorded
graph call may become, and what keeps a variant on the usual path. No compile here:
recorded calls are built by hand; the compiled engine's direct calls are checked
against transformers and against the usual path in test_fidelity.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.engine import graph_call
from pdserve.engine.graph_call import DirectCalls, Variant, disagreement, learn

pytestmark = pytest.mark.unit


class FakeGraph:
    """Stands in for inductor's CompiledFxGraph: a boxed call that clears its list."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.seen: list[list[Any]] = []

    def __call__(self, args: list[Any]) -> list[torch.Tensor]:
        self.seen.append(list(args))
        t, ids, weight, eps, *r, rows = args
        args.clear()
        assert ids.shape == (1, t) and rows.shape == tuple(r or [1])
        return [weight[ids[0, rows]] * eps]


def _args(ids: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor, rows: torch.Tensor) -> Any:
    """As dynamo passes them: each size just before the tensor it sizes; a size of 1 is
    specialised (no int)."""
    sizes = [rows.shape[0]] if rows.shape[0] > 1 else []
    return [ids.shape[1], ids, weight, eps, *sizes, rows]


def _inputs(t: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.arange(t).view(1, t)
    return ids, ids.clone(), torch.arange(t - r, t)


def _recorded(graph: FakeGraph, inputs: Any, eps: torch.Tensor) -> tuple[Variant | str, Any]:
    ids, _, rows = inputs
    args = _args(ids, graph.weight, eps, rows)
    out = graph(list(args))
    return learn(graph, args, out, inputs, out[0]), out[0]


def test_a_recorded_call_becomes_a_template_of_inputs_sizes_and_constants() -> None:
    graph = FakeGraph(torch.randn(16, 4))
    eps = torch.tensor(0.5)
    variant, _ = _recorded(graph, _inputs(6, 3), eps)
    assert isinstance(variant, Variant)
    kinds = [(s.kind, s.index, s.dim) for s in variant.slots]
    assert kinds == [
        ("size", graph_call.IDS, 1),
        ("input", graph_call.IDS, 0),
        ("constant", -1, 0),
        ("constant", -1, 0),
        ("size", graph_call.ROWS, 0),
        ("input", graph_call.ROWS, 0),
    ]
    # A rebuilt scalar of the same value agrees; called with other inputs, the template
    # passes their sizes, not the recorded ones.
    again, _ = _recorded(graph, _inputs(9, 2), torch.tensor(0.5))
    assert isinstance(again, Variant) and disagreement(variant, again) == ""
    ids, positions, rows = _inputs(5, 2)
    out = variant.call((ids, positions, rows))
    assert graph.seen[-1][0] == 5 and graph.seen[-1][4] == 2
    assert torch.equal(out, graph.weight[ids[0, rows]] * 0.5)


def test_what_keeps_a_variant_on_the_usual_path() -> None:
    graph = FakeGraph(torch.randn(16, 4))
    ids, positions, rows = inputs = _inputs(6, 3)
    out = graph([6, ids, graph.weight, torch.tensor(1.0), 3, rows])
    # logits made outside the graph (a copy): not one of its outputs
    why = learn(graph, [6, ids, graph.weight, 3, rows], out, inputs, out[0].clone())
    assert why == "the logits are not one of the graph's outputs"
    # an int that sizes no step input (here a constant follows it)
    why = learn(graph, [6, graph.weight, ids, rows], out, inputs, out[0])
    assert why == "input 0: an int that sizes no step input"
    # an int that is not a size of the input after it
    why = learn(graph, [7, ids, rows], out, inputs, out[0])
    assert why == "input 0: an int that is not one size of the step input after it"
    # a constant that changes between calls (another weight, another epsilon)
    first, _ = _recorded(graph, inputs, torch.tensor(0.5))
    other, _ = _recorded(FakeGraph(graph.weight), inputs, torch.tensor(0.5))
    eps, _ = _recorded(graph, inputs, torch.tensor(0.25))
    assert isinstance(first, Variant) and isinstance(other, Variant) and isinstance(eps, Variant)
    assert disagreement(first, other) == "two calls reached different graphs"
    assert disagreement(first, eps) == "input 3 changed between calls"
    assert positions is not ids


def test_direct_calls_prove_a_variant_on_agreeing_calls_and_refuse_on_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DirectCalls.run: the usual path (recorded) until CONFIRMATIONS calls agree, then
    the graph alone; a variant whose calls disagree keeps the usual path for good."""
    graph = FakeGraph(torch.randn(16, 4))
    eps = [torch.tensor(0.5)]
    usual_calls = []

    class Output:
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits

    def forward(**kw: Any) -> Output:
        usual_calls.append(kw)
        ids, rows = kw["input_ids"], kw["logits_to_keep"]
        recorded = graph_call._recording.get(__import__("threading").get_ident())
        args = _args(ids, graph.weight, eps[0], rows)
        out = graph(list(args))
        if recorded is not None:
            recorded.append((graph, args, out))
        return Output(out[0])

    monkeypatch.setattr(graph_call, "_recorded", _fake_recorder(forward))
    direct = DirectCalls(forward)
    # Two agreeing calls, but the sampled rows' size took one value: not proven yet
    # (an int that only happened to equal a size cannot pass for one).
    recorded = []
    record = graph_call._recorded

    def counting(*a: Any) -> Any:
        recorded.append(1)
        return record(*a)

    monkeypatch.setattr(graph_call, "_recorded", counting)
    # A steady size is recorded twice, then runs unrecorded (nothing new to learn) until a
    # step brings a new size.
    for t, r in ((6, 3), (7, 3), (7, 3), (6, 3), (8, 2), (9, 4)):
        ids, positions, rows = _inputs(t, r)
        got = direct.run(ids, positions, rows)
        assert torch.equal(got, graph.weight[ids[0, rows]] * 0.5)
    assert len(usual_calls) == 5 and len(recorded) == 3 and direct.direct_calls == 1
    assert list(direct.variants) == [(False, False)]
    # one row sampled: another variant, learnt apart; its epsilon changes between calls
    direct.run(*_inputs(6, 1))
    eps[0] = torch.tensor(0.25)
    direct.run(*_inputs(6, 1))
    assert direct.refused == {(False, True): "input 3 changed between calls"}
    direct.run(*_inputs(6, 1))
    assert len(usual_calls) == 5 + 3


def _fake_recorder(forward: Any) -> Any:
    """graph_call._recorded without the spy on inductor's class (FakeGraph records itself)."""
    import threading

    def recorded(fwd: Any, inputs: Any) -> Any:
        calls: list[Any] = []
        graph_call._recording[threading.get_ident()] = calls
        try:
            logits = graph_call._forward(fwd, inputs).logits
        finally:
            del graph_call._recording[threading.get_ident()]
        return logits, calls

    return recorded
