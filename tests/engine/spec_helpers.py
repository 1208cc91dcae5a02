"""Speculative decoding test helpers: an oracle proposer and the non-speculative reference.

The tests' tiny random models rarely repeat their context, so n-gram lookup would draft
little there and nearly every draft would be rejected. To drive acceptance, rejection,
the bonus token and the rollback on every step, these tests swap the engine's proposer for
``Oracle``: it drafts the continuation the non-speculative path produced, with every
``wrong``-th token changed. A verification that accepted a draft without checking it, or
kept a rejected draft's KV, shows as a token that differs from the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine_helpers import Result

from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling_params import SamplingParams

Requests = dict[str, tuple[list[int], SamplingParams]]


class Oracle:
    """Drafts from known continuations (prompt -> output), every ``wrong``-th one wrong."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int = 4, wrong: int = 3):
        self.refs, self.k, self.wrong = refs, k, wrong
        self.proposed = 0

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        k = self.k if k is None else min(k, self.k)
        for prompt, ref in self.refs.items():
            if len(tokens) > len(prompt) and tuple(tokens[: len(prompt)]) == prompt:
                m = len(tokens) - len(prompt)
                draft = [
                    (t + 1) % 3000 if (m + j) % self.wrong == self.wrong - 1 else t
                    for j, t in enumerate(ref[m : m + k])
                ]
                self.proposed += len(draft)
                return draft
        return []


def with_oracle(engine: LLMEngine, refs: dict[str, Result], reqs: Requests, **kw: Any) -> Oracle:
    """Install an oracle drafting each request's reference output."""
    assert engine.spec is not None
    oracle = Oracle({tuple(reqs[r][0]): refs[r].token_ids for r in reqs}, **kw)
    engine.spec.proposer = oracle  # type: ignore[assignment]
    return oracle


def outputs(res: dict[str, Result]) -> dict[str, Any]:
    """What a caller sees of each request: ids, text, finish reason."""
    return {r: (v.token_ids, v.text, v.finish_reason) for r, v in res.items()}
