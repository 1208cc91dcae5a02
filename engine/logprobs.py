"""Log-probabilities of the sampled tokens, as OpenAI reports them.

They come from the model's own distribution: a float32 log-softmax of the raw
logits, taken before logit_bias, penalties, temperature, top-k/top-p/min-p and
any structured-output mask change them (docs/router.md says so). One
log-softmax and one top-k for the rows that ask, per step.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import Request

# (logprob of the chosen token, [(token id, logprob) of the top k, most likely first])
TokenLogprobs = tuple[float, list[tuple[int, float]]]


class StepLogprobs:
    """Taken from a step's logits before the sampler edits them; read after sampling."""

    def __init__(self, logits: torch.Tensor, requests: list[Request]) -> None:
        self.rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        self.k = [requests[i].params.logprobs or 0 for i in self.rows]
        self.logprobs: torch.Tensor | None = None
        if self.rows:
            self.logprobs = torch.log_softmax(logits[self.rows].float(), dim=-1)

    def of(self, tokens: list[int]) -> list[TokenLogprobs | None]:
        """One entry per sampled row: None for rows that did not ask."""
        out: list[TokenLogprobs | None] = [None] * len(tokens)
        if self.logprobs is None:
            return out
        lp = self.logprobs
        chosen = lp[torch.arange(len(self.rows)), torch.tensor([tokens[i] for i in self.rows])]
        top_vals, top_ids = lp.topk(max(self.k), dim=-1) if max(self.k) else (lp[:, :0],) * 2
        for j, row in enumerate(self.rows):
            k = self.k[j]
            top = list(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True))
            out[row] = (float(chosen[j]), top)
        return out
