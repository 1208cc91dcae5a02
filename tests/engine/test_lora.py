"""Multi-LoRA in the engine: one step mixing three PEFT adapters and the base model gives,
for every request, the greedy tokens of transformers' generate() on PEFT's merged model
(``merge_and_unload``, float32); the prefix cache never hands KV across adapters; more
adapters than slots still run (in as many passes as needed); the KV pool ends free."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, tiny_config

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_files import LoraConfig
from pdserve.protocol.contract import LoraRef
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.lora_adapters import SPECS, merged_model, write_adapter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

PROMPTS = [[(i * 37 + s) % 3000 + 5 for i in range(n)] for s, n in [(1, 41), (2, 9), (3, 70)]]
MAX_TOKENS = 10
NAMES = (None, *(s.name for s in SPECS))  # the base model and the three adapters


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {s.name: write_adapter(tiny_model_dir, root / s.name, s) for s in SPECS}


@pytest.fixture(scope="module")
def oracle(
    tiny_model_dir: Path, adapters: dict[str, Path], hf_model: Any
) -> dict[str | None, list[list[int]]]:
    """Per adapter (None: the base model), each prompt's greedy tokens in transformers."""
    want: dict[str | None, list[list[int]]] = {
        None: [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    }
    for name, path in adapters.items():
        model = merged_model(tiny_model_dir, path)
        want[name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return want


@pytest.fixture
def lora_engine(
    make_engine: Callable[..., LLMEngine], adapters: dict[str, Path]
) -> Iterator[Callable[..., LLMEngine]]:
    def make(max_loras: int = 4, max_cpu_loras: int = 8, **overrides: Any) -> LLMEngine:
        config = LoraConfig(
            max_loras, max_cpu_loras, 16, tuple((n, str(p)) for n, p in adapters.items())
        )
        return make_engine(lora=config, **overrides)

    yield make


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _run(engine: LLMEngine, jobs: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Every job added before the first step, so each step mixes all of them."""
    ids = []
    for i, (name, prompt) in enumerate(jobs):
        rid = f"job-{i}-{name}"
        lora = LoraRef(name) if name else None
        engine.add_request(rid, prompt, _params(), lora=lora)
        ids.append(rid)
    got: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_work:
        for out in engine.step():
            assert not out.error, out.error
            got[out.request_id].extend(out.token_ids)
    return [got[rid] for rid in ids]


def test_adapters_differ(oracle: dict[str | None, list[list[int]]]) -> None:
    """The oracle can tell the adapters apart: each changes the base model's tokens."""
    firsts = {name: tuple(map(tuple, oracle[name])) for name in NAMES}
    assert len(set(firsts.values())) == len(NAMES)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "gather"])
def test_one_batch_mixes_three_adapters_and_the_base(
    lora_engine: Callable[..., LLMEngine],
    oracle: dict[str | None, list[list[int]]],
    kernel: bool,
) -> None:
    """The CPU kernel's attention and the gather path (CUDA's reference) alike."""
    engine = lora_engine()
    engine.runner.use_kernel = kernel
    jobs = [(name, prompt) for prompt in PROMPTS for name in NAMES]
    steps: list[int] = []
    execute = engine.runner._execute

    def counting(chunks: Any) -> Any:
        steps.append(len({id(c.request.lora) for c in chunks}))
        return execute(chunks)

    engine.runner._execute = counting  # type: ignore[method-assign]
    got = _run(engine, jobs)
    want = [oracle[name][PROMPTS.index(prompt)] for name, prompt in jobs]
    assert got == want
    assert max(steps) == len(NAMES)  # a pass held the base and the three adapters at once
    assert engine.runner.loras is not None and engine.runner.loras.resident == sorted(
        n for n in NAMES if n
    )
    assert_all_free(engine)


def test_more_adapters_than_slots(
    lora_engine: Callable[..., LLMEngine], oracle: dict[str | None, list[list[int]]]
) -> None:
    """Two slots, three adapters in one step: the step runs in two passes, and a slot
    is reused as requests move on; tokens are still the oracle's."""
    engine = lora_engine(max_loras=2, max_cpu_loras=2)
    loras = engine.runner.loras
    assert loras is not None
    counts = {"restacks": 0, "steps": 0}
    restack, step = loras._restack, engine.step

    def counted_restack() -> None:
        counts["restacks"] += 1
        restack()

    def counted_step() -> Any:
        counts["steps"] += 1
        return step()

    loras._restack = counted_restack  # type: ignore[method-assign]
    engine.step = counted_step  # type: ignore[method-assign]
    jobs = [(name, PROMPTS[0]) for name in NAMES] + [(name, PROMPTS[1]) for name in NAMES[1:]]
    got = _run(engine, jobs)
    assert got == [oracle[name][PROMPTS.index(prompt)] for name, prompt in jobs]
    # One slot change a step at most: the resident pass first, one copy of each adapter.
    assert counts["restacks"] <= counts["steps"] + 1
    assert_all_free(engine)


def test_preempted_requests_recompute_under_their_adapters(
    lora_engine: Callable[..., LLMEngine], oracle: dict[str | None, list[list[int]]]
) -> None:
    """A pool too small for the batch: requests are preempted and their KV recomputed,
    each under its own adapter."""
    engine = lora_engine(num_blocks=16)
    jobs = [(name, prompt) for prompt in PROMPTS for name in NAMES]
    assert _run(engine, jobs) == [oracle[name][PROMPTS.index(prompt)] for name, prompt in jobs]
    assert engine.stats().preemptions > 0
    assert_all_free(engine)


def test_host_lru_reads_an_evicted_adapter_again(
    lora_engine: Callable[..., LLMEngine], oracle: dict[str | None, list[list[int]]]
) -> None:
    engine = lora_engine(max_loras=1, max_cpu_loras=1)
    loras = engine.runner.loras
    assert loras is not None and list(loras.host) == [SPECS[-1].name]  # the last one read
    before = loras.loads
    for name in ("attn8", "mlp4", "attn8"):
        assert _run(engine, [(name, PROMPTS[0])]) == [oracle[name][0]]
    assert loras.loads == before + 3
    assert_all_free(engine)


def test_prefix_cache_is_keyed_by_adapter(lora_engine: Callable[..., LLMEngine]) -> None:
    engine = lora_engine()
    prompt = PROMPTS[2]  # 70 tokens: four full blocks to reuse

    def cached(name: str | None) -> int:
        lora = LoraRef(name) if name else None
        engine.add_request(f"c-{cached.n}", prompt, _params(), lora=lora)  # type: ignore[attr-defined]
        cached.n += 1  # type: ignore[attr-defined]
        n = None
        while engine.has_work:
            for out in engine.step():
                n = out.num_cached_tokens if n is None else n
        assert n is not None
        return n

    cached.n = 0  # type: ignore[attr-defined]
    assert cached("attn8") == 0
    assert cached("mlp4") == 0  # same prompt, other adapter: nothing reused
    assert cached(None) == 0  # nor by the base model
    assert cached("attn8") == 64  # the same adapter again: its four blocks
    assert cached(None) == 64
    assert_all_free(engine)


def test_unknown_adapter_and_hash_mismatch_are_refused(
    lora_engine: Callable[..., LLMEngine],
) -> None:
    engine = lora_engine()
    with pytest.raises(InvalidParameter, match="'nope' is not loaded") as exc:
        engine.add_request("u", PROMPTS[0], _params(), lora=LoraRef("nope"))
    assert exc.value.field == "lora"
    with pytest.raises(InvalidParameter, match="here has hash") as exc:
        engine.add_request("h", PROMPTS[0], _params(), lora=LoraRef("attn8", "0" * 32))
    assert exc.value.field == "lora"
    assert not engine.requests
    assert_all_free(engine)


def test_unload_keeps_running_requests_on_their_weights(
    lora_engine: Callable[..., LLMEngine], oracle: dict[str | None, list[list[int]]]
) -> None:
    engine = lora_engine()
    loras = engine.runner.loras
    assert loras is not None
    engine.add_request("run", PROMPTS[0], _params(), lora=LoraRef("mlp4"))
    out = engine.step()  # the prompt, under mlp4
    assert loras.unload("mlp4")
    tokens = [t for o in out for t in o.token_ids]
    while engine.has_work:
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert tokens == oracle["mlp4"][0]
    with pytest.raises(InvalidParameter):
        engine.add_request("after", PROMPTS[0], _params(), lora=LoraRef("mlp4"))
    assert_all_free(engine)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_engine_goes_eager_when_an_adapter_loads(
    make_engine: Callable[..., LLMEngine],
    adapters: dict[str, Path],
    oracle: dict[str | None, list[list[int]]],
) -> None:
    """A worker compiled at start (no --lora) serves the base model compiled; the first
    adapter to run wraps its layers around the compiled path's packed linears and the
    runner goes eager: every request still gets the oracle's tokens."""
    engine = make_engine(compile=True, lora=LoraConfig(max_lora_rank=16))
    assert engine.runner.compiled
    assert _run(engine, [(None, PROMPTS[0])]) == [oracle[None][0]]
    assert engine.runner.compiled  # adapters only loaded: nothing wrapped yet
    loras = engine.runner.loras
    assert loras is not None
    for name, path in adapters.items():
        loras.load(name, str(path))
    jobs = [(name, PROMPTS[0]) for name in NAMES]
    assert _run(engine, jobs) == [oracle[name][0] for name in NAMES]
    assert not engine.runner.compiled and engine.runner.graphs is None
    assert_all_free(engine)


def test_reload_under_a_name_serves_the_new_weights(
    lora_engine: Callable[..., LLMEngine],
    adapters: dict[str, Path],
    oracle: dict[str | None, list[list[int]]],
) -> None:
    """``mlp4`` reloaded from all16's directory while a request runs under the old mlp4:
    that request keeps its weights (and a slot), a new one gets the new weights, even once
    the host cache has dropped them and the old weights sit in a slot under that name."""
    engine = lora_engine(max_loras=2, max_cpu_loras=2)
    loras = engine.runner.loras
    assert loras is not None
    engine.add_request("old", PROMPTS[0], _params(), lora=LoraRef("mlp4"))
    old = [t for o in engine.step() for t in o.token_ids]
    loras.load("mlp4", str(adapters["all16"]))
    old += [t for o in engine.step() for t in o.token_ids]  # the old weights back in a slot
    loras.resolve(LoraRef("attn8"))
    loras.resolve(LoraRef("all16"))
    assert "mlp4" not in loras.host
    engine.add_request("new", PROMPTS[1], _params(), lora=LoraRef("mlp4"))
    got: dict[str, list[int]] = {"old": old, "new": []}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert got == {"old": oracle["mlp4"][0], "new": oracle["all16"][1]}
    assert_all_free(engine)


def test_adapter_gone_from_disk_is_refused(
    lora_engine: Callable[..., LLMEngine], adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = lora_engine(max_loras=1, max_cpu_loras=1)
    loras = engine.runner.loras
    assert loras is not None
    moved = shutil.copytree(adapters["attn8"], tmp_path / "attn8")
    loras.load("moving", str(moved))
    loras.resolve(LoraRef("mlp4"))  # the host cache (one adapter) drops "moving"
    shutil.rmtree(moved)
    with pytest.raises(InvalidParameter, match="could not be read again") as exc:
        engine.add_request("gone", PROMPTS[0], _params(), lora=LoraRef("moving"))
    assert exc.value.field == "lora" and not engine.requests


def test_bfloat16_mixed_batch(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    """The adapters' weights follow the model's dtype: a bfloat16 batch mixing them runs,
    its base rows are the base model's alone, and each adapter changes its own rows."""
    loras_flag = tuple((n, str(p)) for n, p in adapters.items())
    config = replace(
        tiny_config(tiny_model_dir, lora=LoraConfig(loras=loras_flag)), dtype="bfloat16"
    )
    engine = LLMEngine(config)
    jobs = [(name, PROMPTS[0]) for name in NAMES]
    got = _run(engine, jobs)
    assert got[0] == _run(engine, [(None, PROMPTS[0])])[0]
    assert len({tuple(tokens) for tokens in got}) == len(NAMES)
    loras = engine.runner.loras
    assert loras is not None and all(
        layer.lora_a is not None and layer.lora_a.dtype == torch.bfloat16
        for layer in loras.wrapped.values()
    )
    assert_all_free(engine)
