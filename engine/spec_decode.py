"""Speculative decoding: drafts scheduled with a decode, verified in the same forward.

A decoding request with drafts ``d1..dk`` (engine/ngram_proposer.py, or a draft model:
engine/draft_proposer.py) is scheduled as one
chunk of ``1 + k`` tokens: its last accepted token and the drafts, written to the paged
KV like any chunk, with logits at every one of the ``1 + k`` rows. Row ``j`` is sampled
as the plain path would sample the request's next token had ``d1..dj`` already been
emitted: the sampler sees a view of the request with those drafts appended (penalties,
``min_tokens``, the seeded draw of that output position, the grammar's mask at that state).
The drafts are accepted while each equals its row's sample; the first row that differs
gives the corrected token, and when all k match the last row gives a bonus token. So a
step emits ``1..k+1`` tokens, each exactly what non-speculative decoding would have
emitted: greedy is identical, a seeded request draws the same tokens, and an unseeded one
keeps the target distribution. With a deterministic draft (q one-hot) this is rejection
sampling: the draft is accepted with probability p(d) = min(1, p(d)/q(d)), and a
rejection's token is a sample of p conditioned on != d, the normalised residual
max(p - q, 0).

Drafts cost a wider forward whether or not they are accepted, so the number of drafts
adapts per request (``Backoff``): halved after a verification that accepted none, down to
one, then a pause of ``PAUSE_STEPS`` decodes without drafts; doubled back (up to k) after
one that accepted all. Text that stops copying its context stops paying for drafts.

After verification the KV of the rejected drafts is rolled back: ``num_computed_tokens``
counts only the accepted tokens, blocks past them are freed (fresh blocks, never
registered), and the prefix cache registers only blocks full of accepted tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch

from pdserve.engine import prompt_logprobs
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.draft_proposer import DraftProposer
from pdserve.engine.ngram_proposer import NgramProposer
from pdserve.engine.request import Request
from pdserve.engine.spec_config import SpecConfig
from pdserve.protocol.outputs import RequestOutput

PAUSE_STEPS = 4  # decodes without drafts after a one-draft verification that failed


@dataclass
class Backoff:
    """One request's draft length: ``k`` now, and decodes left before drafting again."""

    k: int
    pause: int = 0

    def after(self, drafted: int, accepted: int, k_max: int) -> None:
        if accepted == drafted:
            self.k = min(k_max, self.k * 2)
        elif accepted == 0:
            if self.k == 1:
                self.pause = PAUSE_STEPS
            self.k = max(1, self.k // 2)


@dataclass
class SpecStats:
    steps: int = 0  # verifications (one request's chunk with drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens those verifications emitted (accepted + 1, or fewer at a stop)


class SpecDecoder:
    def __init__(
        self,
        config: SpecConfig,
        max_model_len: int,
        vocab_size: int,
        draft: DraftProposer | None = None,
    ) -> None:
        """``draft``: the draft model's proposer (``config.method == "draft"``)."""
        self.config = config
        self.proposer: NgramProposer | DraftProposer = draft or NgramProposer(
            config.k, config.min_n, config.max_n
        )
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stats = SpecStats()
        self.backoff: dict[str, Backoff] = {}

    def forget(self, request_id: str) -> None:
        self.backoff.pop(request_id, None)

    def draft(self, req: Request, room: int) -> list[int]:
        """Draft tokens for ``req``'s next decode step (``room``: budget left for them);
        empty when the request decodes plainly this step."""
        if req.hold_kv or prompt_logprobs.wanted(req):  # a prefill worker's first token
            return []
        back = self.backoff.setdefault(req.request_id, Backoff(self.config.k))
        if back.pause > 0:
            back.pause -= 1
            return []
        k = min(
            back.k,
            room,
            req.params.max_tokens - req.num_output_tokens - 1,  # the last row's token too
            self.max_model_len - req.num_tokens - 1,
        )
        if k <= 0:
            return []
        if isinstance(self.proposer, DraftProposer):  # the request's salt keys its cache
            drafts = self.proposer.propose(req.all_token_ids, k, req)
        else:
            drafts = self.proposer.propose(req.all_token_ids, k)
        if drafts and req.grammar is not None:
            drafts = grammar_prefix(req.grammar, drafts)
        return drafts

    def row_requests(self, chunks: list[Any]) -> list[Request]:
        """One request (or a view of it, drafts appended) per sampled row of the step."""
        rows: list[Request] = []
        for c in chunks:
            if not c.samples:
                continue
            rows.append(c.request)
            if c.draft:
                rows += self._ahead(c.request, c.draft)
        return rows

    def _ahead(self, req: Request, draft: tuple[int, ...]) -> list[Request]:
        masks = _grammar_masks(req.grammar, draft, self.vocab_size) if req.grammar else None
        views = []
        for j in range(1, len(draft) + 1):
            view = copy.copy(req)
            view.output_token_ids = req.output_token_ids + list(draft[:j])
            view.grammar = _MaskRow(masks, j - 1) if masks is not None else None
            views.append(view)
        return views

    def accepted(self, req: Request, draft: tuple[int, ...], tokens: list[Any]) -> list[Any]:
        """The tokens a verification emits: the drafts matched by their rows' samples,
        then the first row's own token that differs (or the bonus)."""
        a = 0
        while a < len(draft) and tokens[a] == draft[a]:
            a += 1
        back = self.backoff.get(req.request_id)
        if back is not None:
            back.after(len(draft), a, self.config.k)
        self.stats.steps += 1
        self.stats.draft_tokens += len(draft)
        self.stats.accepted_tokens += a
        return tokens[: a + 1]


def rollback(req: Request, blocks: BlockManager, num_accepted: int, start: int) -> None:
    """The chunk that started at ``start`` computed its first token and ``num_accepted``
    drafts: count those, free the blocks that hold only rejected drafts' KV."""
    req.num_computed_tokens = start + 1 + num_accepted
    keep = blocks.blocks_needed(req.num_computed_tokens)
    if len(req.block_ids) > keep:
        blocks.free(req.block_ids[keep:])
        del req.block_ids[keep:]


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput | None:
    """One output for the tokens a verification emitted (each went through the stop rules
    alone): their ids, text and logprobs in order, the last one's finish and counts."""
    if len(outs) <= 1:
        return outs[0] if outs else None
    last = outs[-1]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    prompt = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    return replace(
        last,
        token_ids=[t for o in outs for t in o.token_ids],
        text="".join(o.text for o in outs),
        logprobs=lps if any(o.logprobs is not None for o in outs) else None,
        prompt_logprobs=prompt,
        queue_seconds=outs[0].queue_seconds,
    )


def grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` the grammar accepts (the matcher is left as it was)."""
    if matcher.is_terminated():
        return []
    n = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        n += 1
        if matcher.is_terminated():
            break
    if n:
        matcher.rollback(n)
    return drafts[:n]


def _grammar_masks(matcher: Any, draft: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """The grammar's token bitmask after each of ``draft[:1] .. draft[:k]``."""
    import xgrammar

    masks = xgrammar.allocate_token_bitmask(len(draft), vocab_size)
    n = 0
    for j, token in enumerate(draft):
        if not matcher.accept_token(token):  # checked when drafted: cannot happen
            break
        n += 1
        if not matcher.is_terminated():  # else the row is past a stop: never emitted
            matcher.fill_next_token_bitmask(masks, j)
    if n:
        matcher.rollback(n)
    return masks


class _MaskRow:
    """Stands for a grammar matcher in a row view: its mask at one draft position."""

    def __init__(self, masks: torch.Tensor, row: int) -> None:
        self.masks, self.row = masks, row

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = self.masks[self.row]
