"""Logit biases and repetition penalties over a step's logits, batched.

Applied to the rows of a step in tensor ops over the whole batch: the Python work
per step is proportional to the token ids involved (to build index tensors),
never to the vocabulary. Order, as vLLM: ``logit_bias`` on the raw logits, then
the repetition penalty (prompt and output tokens), then frequency and presence
(output tokens only). Temperature and ``min_p`` come after, in the sampler.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import Request


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    """Add each request's ``logit_bias`` to its row, in place."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    vocab = logits.shape[-1]
    for row, req in enumerate(requests):
        for tok, bias in req.params.logit_bias.items():
            if tok < vocab:  # the engine refuses ids outside the vocabulary on add
                rows.append(row)
                cols.append(tok)
                vals.append(float(bias))
    if not rows:
        return
    dev = logits.device
    index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    logits.index_put_(index, torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition, frequency and presence penalties on the rows that ask for them."""
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    reqs = [requests[i] for i in rows]
    sub = logits[rows]
    out_counts = token_counts([r.output_token_ids for r in reqs], vocab, dev)
    rep = torch.tensor([r.params.repetition_penalty for r in reqs], device=dev)[:, None]
    if bool((rep != 1.0).any()):
        seen = (token_counts([r.prompt_token_ids for r in reqs], vocab, dev) > 0) | (out_counts > 0)
        # Divide positive logits, multiply negative ones: both make the token less likely.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)
    freq = torch.tensor([r.params.frequency_penalty for r in reqs], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in reqs], device=dev)[:, None]
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
    logits[rows] = sub


def token_counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each token id per sequence (one scatter_add)."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    if width == 0:
        return counts[:, :vocab]
    # Padding points at the extra column ``vocab``, dropped at the end.
    index = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if seq:
            index[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    index = index.clamp_(max=vocab).to(device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab]
