"""Speculative decoding with the P/D hand-off and with LoRA adapters.

* P/D: the decode engine receives the prompt's KV from a prefill engine (the in-process
  connector of test_remote_kv.py) and drafts from the first decode step on.
* LoRA: base and adapter requests speculate in one batch; with one adapter slot the step
  runs as several passes, each with its requests' draft rows.
Drafts come from spec_helpers.Oracle (transformers' tokens, every third one wrong).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import assert_all_free
from spec_helpers import Oracle
from test_remote_kv import PROMPT, InProcessConnector, _prefill

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora_files import LoraConfig
from pdserve.protocol.contract import LoraRef
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.lora_adapters import SPECS, merged_model, write_adapter

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

SPEC = "ngram:k=4"


def test_decode_worker_drafts_after_the_kv_hand_off(
    make_engine: Callable[..., LLMEngine], hf_model: Any
) -> None:
    want = hf_greedy(hf_model, PROMPT, 12)
    prefill, decode = make_engine(num_blocks=64), make_engine(num_blocks=64, speculative=SPEC)
    decode.attach_connector(InProcessConnector(prefill.kv.tensor, decode.kv.tensor))
    assert decode.spec is not None
    decode.spec.proposer = Oracle({tuple(PROMPT): want})  # type: ignore[assignment]
    handle, first = _prefill(prefill, "a")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    decode.add_request("a", PROMPT, params, remote_kv=handle, first_token_id=first)
    outs = []
    while decode.has_work:
        outs += decode.step()
    assert [first] + [t for o in outs for t in o.token_ids] == want
    assert decode.spec.stats.accepted_tokens > 0
    assert prefill.release_held("a")
    assert_all_free(prefill)
    assert_all_free(decode)


def test_lora_requests_speculate_in_one_batch(
    make_engine: Callable[..., LLMEngine],
    tiny_model_dir: Path,
    hf_model: Any,
    tmp_path: Path,
) -> None:
    specs = SPECS[:2]
    paths = {s.name: write_adapter(tiny_model_dir, tmp_path / s.name, s) for s in specs}
    prompts = {
        None: [(i % 6) * 41 + 9 for i in range(30)],
        specs[0].name: [(i % 4) * 77 + 5 for i in range(25)],
        specs[1].name: [(i % 5) * 13 + 2 for i in range(35)],
    }
    want = {
        name: hf_greedy(merged_model(tiny_model_dir, paths[name]) if name else hf_model, p, 12)
        for name, p in prompts.items()
    }
    # One slot: the two adapters cannot share a pass, so the step runs several.
    config = LoraConfig(1, 4, 16, tuple((n, str(p)) for n, p in paths.items()))
    engine = make_engine(lora=config, speculative=SPEC)
    assert engine.spec is not None
    engine.spec.proposer = Oracle({tuple(p): want[n] for n, p in prompts.items()})  # type: ignore[assignment]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for name, p in prompts.items():
        engine.add_request(str(name), p, params, lora=LoraRef(name) if name else None)
    got: dict[str, list[int]] = {str(n): [] for n in prompts}
    while engine.has_work:
        for out in engine.step():
            assert not out.error, out.error
            got[out.request_id] += out.token_ids
    assert got == {str(n): want[n] for n in prompts}
    assert engine.spec.stats.accepted_tokens > 0
    assert_all_free(engine)
