"""Log-probabilities of a request's prompt tokens (OpenAI's ``echo``, vLLM's
``prompt_logprobs``): what evaluation harnesses score a continuation with.

The logits of prompt row ``p`` predict prompt token ``p + 1``. A request that asks keeps
the logits of every prompt row but the last (that one predicts the first output token and
is sampled anyway), and they are reduced to ``[logprob, rank, top]`` in the step that
computes them, so memory grows with the chunk, not the prompt::

    prompt    t0    t1    t2   ...  t(n-1)  | out0
    row        0     1     2   ...   n-1
    predicts  t1    t2    t3   ...  out0 (sampled row)
    entry  [None, lp(t1), lp(t2), ..., lp(t(n-1))]     n entries, the first None

A prefix-cache hit skips rows, so a request whose entries are not all in is admitted
without hits (scheduler); a recompute after preemption skips the rows already recorded.
Like the sampled tokens' (engine/logprobs.py) they come from the model's raw logits, in
float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.request import Request


def wanted(req: Request) -> bool:
    """The request asks for prompt logprobs and some are not computed yet."""
    return req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < len(
        req.prompt_token_ids
    )


@dataclass(frozen=True)
class PromptRows:
    """The rows of a step's flattened tokens whose logits score prompt tokens."""

    rows: list[int]  # row in the step
    owners: list[tuple[Request, int]]  # (request, the prompt position the row sits at)

    @classmethod
    def of(cls, chunks: list) -> PromptRows:  # type: ignore[type-arg]
        rows: list[int] = []
        owners: list[tuple[Request, int]] = []
        offset = 0
        for c in chunks:
            req = c.request
            if wanted(req):
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)  # t0: nothing predicts it
                first = max(c.start, len(req.prompt_logprobs) - 1)
                for p in range(first, min(c.start + c.num_tokens, req.num_prompt_tokens - 1)):
                    rows.append(offset + p - c.start)
                    owners.append((req, p))
            offset += c.num_tokens
        return cls(rows, owners)

    def record(self, logits: torch.Tensor) -> None:
        """Append each row's entry to its request (``logits``: one row per ``rows``)."""
        if not self.rows:
            return
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(
            [r.prompt_token_ids[p + 1] for r, p in self.owners], device=lp.device
        )
        chosen = lp.gather(1, targets[:, None])
        ranks = (lp > chosen).sum(dim=1) + 1
        k = max(r.params.prompt_logprobs or 0 for r, _ in self.owners)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
        ids_l, vals_l = top_ids.tolist(), top_vals.tolist()
        for j, (req, p) in enumerate(self.owners):
            if len(req.prompt_logprobs) != p + 1:  # never misattribute a row
                continue
            n = req.params.prompt_logprobs or 0
            top = list(zip(ids_l[j][:n], vals_l[j][:n], strict=True))
            req.prompt_logprobs.append([chosen_l[j], ranks_l[j], top])


def take(req: Request) -> list | None:  # type: ignore[type-arg]
    """The prompt entries to send with this output, once all are in; None otherwise."""
    if req.params.prompt_logprobs is None or req.prompt_logprobs_sent:
        return None
    if len(req.prompt_logprobs) < len(req.prompt_token_ids):
        return None
    req.prompt_logprobs_sent = True
    return list(req.prompt_logprobs)
