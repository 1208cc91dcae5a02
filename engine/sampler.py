"""Per-request sampling over a step's logits.

Logit biases and penalties come first, batched (engine/penalties.py). Greedy
rows then take the argmax. Other rows apply temperature, top-k and top-p (on
sorted logits, only when set) and min-p, then draw with the exponential-race trick (argmax
of p / E with E ~ Exp(1) per token id), whose noise comes from the request's own
generator: a seeded request draws the same tokens whatever else shares its batch.
A seeded generator is re-seeded from (seed, output position) before each draw, so
the draw for the n-th output token is the same on whichever worker makes it: a
prefill worker's first token and the decode worker's next, a request recomputed
after preemption, or a stream migrated to another decode worker mid-way.
"""

from __future__ import annotations

import torch

from pdserve.engine.penalties import apply_logit_bias, apply_penalties
from pdserve.engine.request import Request


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._default = torch.Generator(device=device)
        self._default.manual_seed(seed)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()  # the logits are inference tensors: banning writes into them
    def sample(
        self, logits: torch.Tensor, requests: list[Request], banned: list[list[int]]
    ) -> list[int]:
        """One token per row of ``logits`` ([S, V] float32); ``banned`` ids get -inf."""
        if not any(banned) and all(_plain_greedy(r) for r in requests):
            return [int(t) for t in argmax_rows(logits).tolist()]  # the common batch
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
        apply_logit_bias(logits, requests)
        apply_penalties(logits, requests)
        dev = logits.device
        out = torch.empty(len(requests), dtype=torch.long, device=dev)
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        if greedy:
            out[greedy] = argmax_rows(logits[greedy]).to(dev)
        rest = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rest:
            out[rest] = self._sample_random(logits[rest], [requests[i] for i in rest])
        return [int(t) for t in out.tolist()]

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in requests], device=dev)
        probs = self._filtered_probs(logits / temps[:, None], requests)
        # Noise indexed by token id, not by rank: logits that differ in the last bits
        # (another batch, another kernel) may swap ranks but never reshuffle the noise.
        noise = torch.empty_like(probs)
        for row, req in enumerate(requests):
            noise[row].exponential_(generator=self._generator(req))
        return argmax_rows(probs / noise).to(dev)

    def _filtered_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Softmax after top-k, top-p and min-p, in vocabulary order (not renormalised:
        the exponential race only compares ratios)."""
        probs = self._top_k_top_p(logits, requests)
        min_p = [r.params.min_p for r in requests]
        if max(min_p) > 0.0:
            floor = torch.tensor(min_p, device=probs.device)[:, None] * probs.amax(-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs

    def _top_k_top_p(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in requests]
        top_p = [r.params.top_p for r in requests]
        if min(top_k) >= vocab and min(top_p) >= 1.0:
            return logits.softmax(dim=-1)
        dev = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= torch.tensor(top_k, device=dev)[:, None]
        p = torch.tensor(top_p, device=dev)
        if bool((p < 1.0).any()):
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p.
            drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        return torch.zeros_like(probs).scatter_(1, order, probs)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self._default
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            self._generators[req.request_id] = gen
        gen.manual_seed(position_seed(req.params.seed, req.num_output_tokens))
        return gen


def _plain_greedy(req: Request) -> bool:
    p = req.params
    return p.greedy and not p.logit_bias and not p.has_penalties


def position_seed(seed: int, position: int) -> int:
    """A 64-bit seed for the draw of output token ``position`` (an LCG-style mix)."""
    return (seed * 6364136223846793005 + (position + 1) * 1442695040888963407) % (1 << 64)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax ([S, V] -> [S] int64), the first maximum (NaN counting as one),
    as ``torch.argmax``. On CPU numpy's vectorised argmax runs it: measured 18-26x faster
    than torch's over 16 float32 rows of 3k-128k ids (one thread), e.g. 0.57 vs 4.9 ms for
    a 128k vocabulary, which would be a large share of a decode step."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 2:
        return torch.from_numpy(x.detach().contiguous().numpy().argmax(axis=-1))
    return x.argmax(dim=-1)
