"""Scheduler: token budget, chunked prefill, admission, preemption, freeing.

The model is replaced by a fake step (every sampled row yields token 5): the
scheduler sees only token counts and blocks, so no forward pass is needed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from engine_helpers import assert_all_free

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_manager import KVCacheManager
from pdserve.engine.kv_pool import KVPool, KVShape
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched_output import ScheduledChunk, SchedulerOutput
from pdserve.engine.scheduler import Scheduler
from pdserve.protocol.hashing import block_hashes
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 16


@dataclass
class Harness:
    """A scheduler over a real BlockManager, stepped with fake model outputs."""

    sched: Scheduler
    finished: list[Request] = field(default_factory=list)
    steps: list[list[ScheduledChunk]] = field(default_factory=list)

    @classmethod
    def make(cls, num_blocks: int, **config: int) -> Harness:
        cfg = EngineConfig(model="unused", block_size=BS, **config)  # type: ignore[arg-type]
        # A real KV manager over a one-float-per-slot pool: the scheduler owns it.
        pool = KVPool(KVShape(1, 1, 1, BS, torch.float32), num_blocks, torch.device("cpu"))
        return cls(Scheduler(cfg, KVCacheManager(pool, BS, enable_prefix_caching=True)))

    @property
    def blocks(self) -> BlockManager:
        return self.sched.kv.block_manager

    def add(self, rid: str, prompt_len: int, max_tokens: int = 4, tenant: str = "") -> Request:
        prompt = [10 + (hash(rid) + i) % 1000 for i in range(prompt_len)]
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        req.block_hashes = block_hashes(prompt, BS)
        req.tenant = tenant
        self.sched.add(req)
        return req

    def step(self) -> list[ScheduledChunk]:
        out = self.sched.schedule()
        self.apply(out)
        return out.chunks

    def apply(self, out: SchedulerOutput) -> None:
        """What the engine's update does, with token 5 for every sampled row."""
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                req.output_token_ids.append(5)
                if req.num_output_tokens >= req.params.max_tokens:
                    self.finish(req)
        self.steps.append(out.chunks)

    def finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED_LENGTH
        self.sched.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        self.finished.append(req)

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("scheduler did not drain")


def test_token_budget_is_respected() -> None:
    h = Harness.make(256, max_num_batched_tokens=40)
    for i in range(12):
        h.add(f"r{i}", 10 + 17 * i, max_tokens=3 + i)
    h.run()
    assert len(h.finished) == 12
    assert all(sum(c.num_tokens for c in step) <= 40 for step in h.steps)
    assert max(sum(c.num_tokens for c in step) for step in h.steps) == 40
    assert all(r.num_output_tokens == r.params.max_tokens for r in h.finished)
    assert_all_free(h.blocks)


def test_chunked_prefill_samples_only_the_last_chunk() -> None:
    h = Harness.make(64, max_num_batched_tokens=32)
    req = h.add("long", 100, max_tokens=2)
    steps = [h.step() for _ in range(4)]
    sizes = [(c.start, c.num_tokens, c.samples) for step in steps for c in step]
    assert sizes == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert req.num_output_tokens == 1
    h.run()
    assert_all_free(h.blocks)


def test_decodes_go_first_and_prefill_chunks_fill_the_rest() -> None:
    h = Harness.make(64, max_num_batched_tokens=20)
    a = h.add("a", 8, max_tokens=10)
    b = h.add("b", 9, max_tokens=10)
    h.step()  # both prefills fit: 17 tokens
    c = h.add("c", 50, max_tokens=2)
    step = h.step()
    assert [(x.request, x.num_tokens) for x in step] == [(a, 1), (b, 1), (c, 18)]
    step = h.step()
    assert [(x.request, x.num_tokens) for x in step] == [(a, 1), (b, 1), (c, 18)]
    h.run()
    assert_all_free(h.blocks)


def test_admission_only_when_blocks_are_free() -> None:
    # Each request needs 7 blocks (100 prompt tokens + room for the first output); 10 exist.
    h = Harness.make(10, max_num_batched_tokens=512)
    first = h.add("first", 100, max_tokens=3)
    second = h.add("second", 100, max_tokens=3)
    h.step()
    assert first.status is RequestStatus.RUNNING and second.status is RequestStatus.WAITING
    assert list(h.sched.waiting) == [second]
    while first.status is RequestStatus.RUNNING:
        h.step()
        if first.status is RequestStatus.RUNNING:
            assert second.status is RequestStatus.WAITING
    assert second.status is RequestStatus.WAITING  # admitted the step after first finished
    h.step()
    assert second.status is RequestStatus.RUNNING
    h.run()
    assert h.sched.num_preemptions == 0
    assert_all_free(h.blocks)


def test_max_num_seqs() -> None:
    h = Harness.make(256, max_num_seqs=3)
    for i in range(7):
        h.add(f"r{i}", 5, max_tokens=4)
    while h.sched.has_work:
        h.step()
        assert len(h.sched.running) <= 3
    assert len(h.finished) == 7
    assert_all_free(h.blocks)


def test_preemption_takes_the_newest_first_and_requeues_it_in_front() -> None:
    # Three 30-token requests take 2 blocks each of 7; decoding past 32 tokens needs a
    # third block each: only one more fits, so the newest two are preempted in turn.
    h = Harness.make(7, max_num_batched_tokens=512)
    reqs = [h.add(f"r{i}", 30, max_tokens=6) for i in range(3)]
    h.add("late", 10, max_tokens=1)  # waits: admission stops when preemption happens
    h.step()
    preempted: list[str] = []
    while h.sched.has_work:
        before = {r.request_id: r.num_preemptions for r in reqs}
        h.step()
        preempted += [r.request_id for r in reqs if r.num_preemptions > before[r.request_id]]
        if preempted and not h.finished:
            assert h.sched.waiting[0].request_id == preempted[-1]
    assert preempted[0] == "r2"
    assert reqs[0].num_preemptions == 0
    assert h.sched.num_preemptions == len(preempted)
    assert {r.request_id for r in h.finished} == {"r0", "r1", "r2", "late"}
    assert all(r.num_output_tokens == r.params.max_tokens for r in reqs)
    assert_all_free(h.blocks)


def test_victims_are_always_newer_than_every_survivor() -> None:
    h = Harness.make(14, max_num_batched_tokens=512)
    reqs = [h.add(f"r{i}", 20 + 3 * i, max_tokens=40) for i in range(8)]
    order = {r.request_id: i for i, r in enumerate(reqs)}
    steps_with_preemption = 0
    while h.sched.has_work:
        out = h.sched.schedule()
        if out.preempted:
            steps_with_preemption += 1
            newest_survivor = max(order[r.request_id] for r in h.sched.running)
            assert all(order[v.request_id] > newest_survivor for v in out.preempted)
            ranks = [order[v.request_id] for v in out.preempted]
            assert ranks == sorted(ranks, reverse=True)  # newest first
        h.apply(out)
    assert steps_with_preemption > 2
    assert all(r.num_output_tokens == 40 for r in reqs)
    assert_all_free(h.blocks)


def test_preempted_request_recomputes_prompt_and_output() -> None:
    h = Harness.make(7, max_num_batched_tokens=512)
    reqs = [h.add(f"r{i}", 30, max_tokens=6) for i in range(3)]
    h.run()
    again = [r for r in reqs if r.num_preemptions]
    assert again
    # After a preemption the request starts over from token 0, outputs included.
    computed = {}
    for step in h.steps:
        for c in step:
            computed.setdefault(c.request.request_id, []).append((c.start, c.num_tokens))
    for r in again:
        restarts = [s for s, _ in computed[r.request_id] if s == 0]
        assert len(restarts) == r.num_preemptions + 1
    assert_all_free(h.blocks)


def test_finished_requests_free_their_blocks_at_once() -> None:
    h = Harness.make(32, max_num_batched_tokens=512)
    req = h.add("r", 40, max_tokens=1)
    h.step()
    assert req in h.finished
    assert_all_free(h.blocks)
    assert not h.sched.has_work


def test_remove_takes_waiting_and_running_requests_out() -> None:
    h = Harness.make(8, max_num_batched_tokens=512)
    running = h.add("run", 60, max_tokens=50)
    waiting = h.add("wait", 60, max_tokens=50)
    h.step()
    assert running.status is RequestStatus.RUNNING and waiting in h.sched.waiting
    for req in (running, waiting):
        req.status = RequestStatus.FINISHED_ABORTED
        h.sched.remove(req)
        h.blocks.free(req.block_ids)
        req.block_ids = []
    assert not h.sched.has_work
    assert_all_free(h.blocks)
