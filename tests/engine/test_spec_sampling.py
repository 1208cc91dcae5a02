"""Sampled speculative decoding keeps the target distribution (rejection sampling with a
deterministic draft, q one-hot: engine/spec_decode.py).

The tiny model samples 4 tokens after a fixed prompt with top_k=2, so the output is one
of 16 sequences whose exact probabilities come from transformers' own logits (15
forwards). The first token is sampled by the prefill; the one decode step then verifies
two drafts (the most likely continuation) and emits 1-3 tokens. Many unseeded requests'
outputs against those probabilities: a chi-square test at alpha = 0.001. The same
test would catch a verification that always accepted the first draft (checked on the
probabilities: the statistic it would give is far past the bound).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_all_free, tiny_config

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

PROMPT = [(i % 5) * 61 + 17 for i in range(20)]
N = 600
CHI2_CRIT = {15: 37.70, 14: 36.12, 13: 34.53, 12: 32.91, 11: 31.26, 10: 29.59}  # alpha 0.001
TEMPERATURE = 1.5


def _top2(hf: Any, prefix: tuple[int, ...]) -> dict[int, float]:
    with torch.inference_mode():
        logits = hf(torch.tensor([list(prefix)])).logits[0, -1].float() / TEMPERATURE
    vals, ids = logits.topk(2)
    probs = vals.softmax(-1)
    return {int(i): float(p) for i, p in zip(ids, probs, strict=True)}


def _tree(hf: Any) -> tuple[dict[tuple[int, ...], float], dict[tuple[int, ...], list[int]]]:
    """Exact probability of every 4-token output, and the drafts after each first token."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    drafts: dict[tuple[int, ...], list[int]] = {}
    for _depth in range(4):
        nxt = {}
        for seq, p in probs.items():
            for tok, q in _top2(hf, tuple(PROMPT) + seq).items():
                nxt[(*seq, tok)] = p * q
        probs = nxt
    for seq in {s[:1] for s in probs}:
        d1 = max(_top2(hf, tuple(PROMPT) + seq).items(), key=lambda kv: kv[1])[0]
        d2 = max(_top2(hf, tuple(PROMPT) + seq + (d1,)).items(), key=lambda kv: kv[1])[0]
        drafts[seq] = [d1, d2]
    return probs, drafts


class _Fixed:
    """Drafts the most likely continuation after the first output token."""

    def __init__(self, drafts: dict[tuple[int, ...], list[int]]) -> None:
        self.drafts = drafts

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        out = tuple(tokens[len(PROMPT) :])
        return self.drafts.get(out, [])[: k or 2]


def _chi2(
    counts: Counter[tuple[int, ...]], probs: dict[tuple[int, ...], float], n: int
) -> tuple[float, int]:
    """The statistic over cells expected >= 5 (the rest pooled into one) and its dof."""
    big = [s for s, p in probs.items() if p * n >= 5]
    rest_p = sum(p for s, p in probs.items() if s not in big)
    cells = [(counts[s], probs[s] * n) for s in big]
    if rest_p * n >= 5:
        cells.append((n - sum(counts[s] for s in big), rest_p * n))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def test_sampled_outputs_keep_the_target_distribution(tiny_model_dir: Path, hf_model: Any) -> None:
    probs, drafts = _tree(hf_model)
    engine = LLMEngine(
        tiny_config(
            tiny_model_dir,
            1024,
            speculative="ngram:k=2",
            max_num_seqs=N,
            max_num_batched_tokens=N * 21,
        )
    )
    assert engine.spec is not None
    engine.spec.proposer = _Fixed(drafts)  # type: ignore[assignment]
    params = SamplingParams(max_tokens=4, temperature=TEMPERATURE, top_k=2, ignore_eos=True)
    for i in range(N):
        engine.add_request(str(i), PROMPT, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(N)}
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    assert_all_free(engine)
    counts = Counter(tuple(v) for v in got.values())
    assert set(counts) <= set(probs)
    s = engine.spec.stats
    assert s.steps == N and 0 < s.accepted_tokens < s.draft_tokens  # both outcomes happen
    stat, dof = _chi2(counts, probs, N)
    assert dof >= 10, probs
    assert stat < CHI2_CRIT[dof], (stat, dof, counts)
    # The test's power: always accepting the first draft would be far out of bounds.
    wrong: Counter[tuple[int, ...]] = Counter()
    for seq, p in probs.items():
        if seq[1] == drafts[seq[:1]][0]:
            cond = sum(q for t, q in probs.items() if t[:2] == seq[:2])
            first_p = sum(q for t, q in probs.items() if t[:1] == seq[:1])
            wrong[seq] = round(p / cond * first_p * N)
    assert _chi2(wrong, probs, N)[0] > 3 * CHI2_CRIT[dof]
