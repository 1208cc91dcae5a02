"""The draft-model proposer: a small model that shares the target's tokenizer drafts the
next k tokens greedily; the target verifies them in one forward (engine/spec_decode.py).

The draft model runs in an engine of its own (engine/llm_engine.py: the same device and
dtype, the eager forward, a small paged KV pool of its own, prefix caching on). A draft
is one greedy request of ``k`` tokens on that engine: its prompt is the target request's
tokens so far, so the pool's prefix cache keeps what the previous draft of the same
request computed (every full block of the accepted tokens), and only the last partial
block and the newly accepted tokens run through the draft model again. Rejected drafts'
KV is never reused: the draft request ends with every block released (cached blocks are
keyed by their tokens, so a block holding a rejected draft matches only the same tokens
again), which is the rollback. Nothing of the draft engine outlives a call: every block is
free between steps (tests check it).

Greedy drafts are a deterministic proposer (q one-hot on the draft), so the target's
verification, plain token matching for greedy and rejection sampling for sampled
requests, keeps the target's output exact (docs/speculative.md).

The draft must share the target's vocabulary: the same ``vocab_size`` and the same
tokenizer vocabulary (token to id), else it is refused by name at start.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.engine.request import Request
from pdserve.protocol.hashing import ROOT_HASH
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.engine_view import EngineView

logger = logging.getLogger(__name__)
FIELD = "speculative"


def draft_config(target: EngineConfig, model: str) -> EngineConfig:
    """The draft engine's config: the target's device, dtype and block size; eager; one
    request at a time; no tiers, adapters or speculation of its own (its pool is sized
    by ``pool_bytes`` once the model's KV shape is known)."""
    if not Path(model, "config.json").is_file():
        raise ValueError(f"{FIELD}: draft model {model!r} is not an HF model directory")
    return EngineConfig(
        model=model,
        dtype=target.dtype,
        device=target.device,
        block_size=target.block_size,
        max_num_seqs=1,
        max_num_batched_tokens=target.max_num_batched_tokens,
        max_model_len=target.max_model_len,
        seed=target.seed,
    )


def pool_bytes(bytes_per_block: int, block_size: int, max_model_len: int) -> int:
    """Room for two requests of the longest length: one drafting, one's blocks cached."""
    return bytes_per_block * (2 * math.ceil((max_model_len + 16) / block_size) + 2)


def sized(config: EngineConfig, bytes_per_block: int, max_model_len: int) -> EngineConfig:
    budget = pool_bytes(bytes_per_block, config.block_size, max_model_len)
    return replace(config, kv_cache_bytes=budget)


def check_vocab(draft: EngineView, target: EngineView, model: str) -> None:
    """Refuse a draft model whose ids mean other tokens than the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"{FIELD}: draft model {model!r} has vocab_size {draft.vocab_size}, the target "
            f"{target.vocab_size}: a draft model must share the target's tokenizer"
        )
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"{FIELD}: draft model {model!r} has another tokenizer than the target (its "
            "token ids mean other tokens): a draft model must share the target's tokenizer"
        )


class DraftProposer:
    """``propose(tokens, k)`` like NgramProposer's, from the draft engine's greedy output."""

    def __init__(self, engine: EngineView, k: int) -> None:
        self.engine = engine
        self.k = k
        self.ids = itertools.count()

    def propose(
        self, tokens: Sequence[int], k: int | None = None, req: Request | None = None
    ) -> list[int]:
        """Up to ``k`` greedy draft tokens that continue ``tokens`` (``req``: the target's
        request, whose cache salt keys the draft's cached blocks)."""
        k = self.k if k is None else min(k, self.k)
        if k <= 0 or len(tokens) + k > self.engine.max_model_len:
            return []
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        salted = req is not None and req.hash_root != ROOT_HASH
        salt = f"{req.hash_root:x}" if salted else None  # type: ignore[union-attr]
        rid = f"draft-{next(self.ids)}"
        try:  # the tenant's salt: its cached blocks are its own, as in the target's pool
            self.engine.add_request(rid, list(tokens), params, cache_salt=salt)
        except InvalidParameter:
            return []
        out: list[int] = []
        try:
            while self.engine.has_work:
                for o in self.engine.step():
                    out += o.token_ids
        except Exception:  # a draft can never fail the target's step: no drafts this time
            logger.exception("draft model step failed: decoding without drafts")
            self.engine.abort(rid)
            return []
        return out[:k]

    @property
    def all_free(self) -> bool:
        return bool(self.engine.kv.all_free) and not self.engine.requests
