"""Resuming a request from tokens it already produced elsewhere (stream migration).

The router migrates a stream off a decode worker that died by sending the prompt
and the tokens already sent as ``resume_token_ids``: the engine must continue
exactly as the uninterrupted request would have, and send no text twice.
"""

from __future__ import annotations

import pytest
from engine_helpers import assert_all_free

from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

PROMPT = [(i * 53) % 2900 + 7 for i in range(40)]


def _run_one(engine, rid, prompt, params, **kw):
    """(token ids, text deltas one per output, finish reason) of one request run alone."""
    engine.add_request(rid, prompt, params, **kw)
    ids, texts, finish = [], [], None
    while engine.has_work:
        for out in engine.step():
            ids += out.token_ids
            texts.append(out.text)
            finish = out.finish_reason
    return ids, texts, finish


@pytest.mark.parametrize("cut", [1, 5, 13])
def test_resume_continues_token_for_token_and_text_for_text(make_engine, cut: int) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full_ids, full_texts, finish = _run_one(engine, "a", PROMPT, params)
    assert len(full_ids) == len(full_texts) == 20 and finish == "length"
    sent_text = "".join(full_texts[:cut])  # what the worker that died had sent
    ids, texts, finish = _run_one(engine, "b", PROMPT, params, resume_token_ids=full_ids[:cut])
    assert full_ids[:cut] + ids == full_ids
    assert finish == "length"
    assert sent_text + "".join(texts) == "".join(full_texts)
    assert_all_free(engine)


def test_resume_counts_toward_min_tokens_and_rejects_bad_ids(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidParameter, match="resume"):
        engine.add_request("x", PROMPT, SamplingParams(max_tokens=3), resume_token_ids=[1, 2, 3])
    with pytest.raises(InvalidParameter, match="resume"):
        engine.add_request("y", PROMPT, SamplingParams(max_tokens=9), resume_token_ids=[10**9])
    assert_all_free(engine)


@pytest.mark.parametrize("cut", [1, 7])
def test_seeded_resume_draws_what_the_uninterrupted_run_drew(make_engine, cut: int) -> None:
    # The sampler seeds each draw from (seed, output position), not from a generator
    # that lived on the worker that died: the continuation is the same sample.
    engine = make_engine()
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    full_ids, _, _ = _run_one(engine, "a", PROMPT, params)
    ids, _, _ = _run_one(engine, "b", PROMPT, params, resume_token_ids=full_ids[:cut])
    assert full_ids[:cut] + ids == full_ids
    other, _, _ = _run_one(
        engine,
        "c",
        PROMPT,
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1235, ignore_eos=True),
    )
    assert other != full_ids
    assert_all_free(engine)


def test_structured_resume_replays_the_grammar(make_engine) -> None:
    # A migrated json_schema stream: the new worker's matcher starts after the resumed
    # tokens, so the continuation is the uninterrupted run's (seeded) and still valid JSON.
    import json

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    spec = {"type": "json_schema", "schema": schema, "param": "response_format"}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=spec)
    engine = make_engine()
    full_ids, full_texts, finish = _run_one(engine, "a", PROMPT, params)
    assert finish == "stop" and len(full_ids) > 3
    json.loads("".join(full_texts))
    ids, texts, _ = _run_one(engine, "b", PROMPT, params, resume_token_ids=full_ids[:3])
    assert full_ids[:3] + ids == full_ids
    assert "".join(full_texts[:3]) + "".join(texts) == "".join(full_texts)
    with pytest.raises(InvalidParameter):  # tokens the grammar forbids are refused
        engine.add_request("c", PROMPT, params, resume_token_ids=[PROMPT[5]] * 3)
    assert_all_free(engine)
