"""Decode CUDA graphs without a GPU: bucket choice, padding, the eager fall-through, and
the capture path up to the CUDA calls.

There is no GPU here, so the graph runner is a fake (say so: a mock where the real thing
cannot run): its "replay" re-runs the captured step, which reads only the static input
tensors, so a step that read anything else would show here as wrong outputs. The real
runner's capture sequence runs against stand-ins for torch.cuda's stream/graph calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.engine import cuda_graphs as cg

pytestmark = pytest.mark.unit

BUCKETS = (1, 2, 4, 8)


class FakeGraphRunner:
    """Capture runs the step once; replay runs it again over the same static tensors."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.captured.append(int(step().shape[0]))
        return step


def toy_step(view: cg.StepView) -> torch.Tensor:
    """'Logits' that depend on every static input of the row (and only on those)."""
    first_block = view.tables[:, 0].long()
    return torch.stack(
        [
            view.input_ids,
            view.positions,
            view.slot_mapping,
            first_block,
            view.tile_count.long(),
            view.tile_ctx.long(),
            view.tile_row.long(),
        ],
        dim=1,
    )


def batch(n: int, base: int = 0) -> cg.DecodeBatch:
    pos = [base + 10 * i + 3 for i in range(n)]
    return cg.DecodeBatch(
        token_ids=[100 + base + i for i in range(n)],
        positions=pos,
        slots=[1000 + base + i for i in range(n)],
        block_tables=[[50 + base + i] * (p // 16 + 1) for i, p in enumerate(pos)],
    )


def graphs(runner: Any = None, max_blocks: int = 8) -> cg.DecodeGraphs:
    g = cg.DecodeGraphs(
        toy_step, max_blocks, torch.device("cpu"), runner or FakeGraphRunner(), BUCKETS
    )
    g.capture()
    return g


def eager_never(_b: cg.DecodeBatch) -> torch.Tensor:
    raise AssertionError("this step fits a bucket: it must replay")


def test_bucket_choice() -> None:
    g = graphs()
    assert [g.bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert g.runner.captured == [8, 4, 2, 1]  # type: ignore[attr-defined]  # largest first


def test_replay_pads_to_the_bucket() -> None:
    g = graphs()
    g.run(batch(4, base=7), eager_never)  # leaves real values in rows 0..3
    out = g.run(batch(3), eager_never)
    assert g.replays == 2 and g.eager_steps == 0
    b = batch(3)
    want = [
        [b.token_ids[i], b.positions[i], b.slots[i], b.block_tables[i][0], 1, b.positions[i] + 1, i]
        for i in range(3)
    ]
    assert out.tolist() == want  # only the batch's rows come back
    # Row 3 of bucket 4 is padding again (the previous batch's row is gone): no KV write,
    # a tile of zero tokens, token 0.
    view = g.inputs.view(4)
    assert view.slot_mapping[3] == cg.PAD_SLOT and view.tile_count[3] == 0
    assert view.input_ids[3] == 0 and view.positions[3] == 0
    # Every bucket's view shares the static tensors' storage (fixed addresses).
    assert view.input_ids.data_ptr() == g.inputs.input_ids.data_ptr()


def test_eager_fall_through() -> None:
    g = graphs()
    seen: list[int] = []

    def eager(b: cg.DecodeBatch) -> torch.Tensor:
        seen.append(b.size)
        return torch.zeros(b.size, 7, dtype=torch.int64)

    assert g.run(batch(9), eager).shape == (9, 7)  # larger than the largest bucket
    uncaptured = cg.DecodeGraphs(toy_step, 8, torch.device("cpu"), FakeGraphRunner(), BUCKETS)
    uncaptured.run(batch(2), eager)  # no graphs yet
    assert seen == [9, 2] and g.replays == 0 and g.eager_steps == 1


def test_context_wider_than_the_graphs_is_refused() -> None:
    g = graphs(max_blocks=2)
    with pytest.raises(ValueError, match="3 blocks exceeds the graphs' 2"):
        g.run(cg.DecodeBatch([1], [40], [5], [[1, 2, 3]]), eager_never)


def test_cuda_runner_capture_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaGraphRunner up to the CUDA calls: warm-up on a side stream, then one recorded
    run per bucket in one shared memory pool; replay is graph.replay() + the same output."""
    events: list[str] = []

    class Stream:
        def wait_stream(self, _s: object) -> None:
            events.append("wait")

    class Graph:
        def __init__(self) -> None:
            self.id = sum(e.startswith("graph") for e in events)
            events.append(f"graph{self.id}")

        def pool(self) -> tuple[int, int]:
            return (self.id, 0)

        def replay(self) -> None:
            events.append(f"replay{self.id}")

    class Ctx:
        def __init__(self, name: str) -> None:
            self.name = name

        def __enter__(self) -> None:
            events.append(f"enter {self.name}")

        def __exit__(self, *_: object) -> None:
            events.append(f"exit {self.name}")

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: Ctx("side stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool: Ctx(f"capture pool={pool}"))
    runner = cg.CudaGraphRunner(warmup=2)
    g = cg.DecodeGraphs(toy_step, 8, torch.device("cpu"), runner, (1, 4))

    def step(view: cg.StepView) -> torch.Tensor:
        events.append(f"step{view.input_ids.shape[0]}")
        return toy_step(view)

    g.step = step
    g.capture()
    per_bucket = ["wait", "enter side stream", "step{b}", "step{b}", "exit side stream", "wait"]
    first = [e.format(b=4) for e in per_bucket] + ["graph0", "enter capture pool=None"]
    second = [e.format(b=1) for e in per_bucket] + ["graph1", "enter capture pool=(0, 0)"]
    assert events == [
        *first,
        "step4",
        "exit capture pool=None",
        *second,
        "step1",
        "exit capture pool=(0, 0)",
    ]
    events.clear()
    out = g.run(batch(3), eager_never)
    assert events == ["replay0"] and out.shape == (3, 7)  # the captured output, no step run
