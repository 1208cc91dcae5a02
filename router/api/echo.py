"""``echo`` and prompt log-probabilities on /v1/completions: what evaluation harnesses
(lm-evaluation-harness's ``local-completions``, OpenAI's legacy ``echo``) score with.

* ``echo: true``: the choice's text starts with the prompt; with ``logprobs: N`` its
  ``logprobs`` start with the prompt's tokens (the first one's logprob and top are null,
  nothing predicts it), then the completion's, ``text_offset`` running through both.
* ``echo: true, max_tokens: 0``: the prompt is scored, nothing is generated (the workers
  run one token, which is dropped: ``finish_reason`` "length", 0 completion tokens).
* vLLM's ``prompt_logprobs: K``: the choice's ``prompt_logprobs`` is
  ``[null, {token_id: {logprob, rank, decoded_token}}, ...]``, the prompt token and the
  top K per position.

The engine computes the prompt entries (engine/prompt_logprobs.py) where the prompt is
prefilled: the prefill worker sends them with the first token, a decode worker that
prefilled locally on its first stream line; dispatch keeps the first (``RequestState``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pdserve.router.api import openai_response
from pdserve.router.api.logprobs_format import LogprobsFormatter
from pdserve.router.errors import APIError, invalid
from pdserve.router.transport.dispatch import Delta, RequestState

MAX_PROMPT_LOGPROBS = 20


@dataclass(frozen=True)
class EchoSpec:
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: top K per prompt token
    score_only: bool = False  # echo with max_tokens 0

    def engine_k(self, logprobs: int | None) -> int | None:
        """The top-k the engine computes per prompt token (None: no prompt logprobs)."""
        ks = [k for k in (logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(ks) if ks else None


def parse_echo(body: dict[str, Any], n: int, best_of: int) -> EchoSpec | None:
    """The request's echo settings; None when it asks for neither echo nor prompt logprobs."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo must be a boolean", "echo")
    k = body.get("prompt_logprobs")
    if k is not None and (
        isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_PROMPT_LOGPROBS
    ):
        raise invalid(
            f"prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}]", "prompt_logprobs"
        )
    if not echo and k is None:
        return None
    if n > 1 or best_of > 1:
        name = "echo" if echo else "prompt_logprobs"
        raise invalid(f"{name} needs n = best_of = 1 on this server", name)
    score_only = bool(echo) and body.get("max_tokens") == 0
    return EchoSpec(bool(echo), k, score_only)


async def scored_only(
    rs: RequestState, events: AsyncGenerator[Delta, None]
) -> AsyncGenerator[Delta, None]:
    """``max_tokens: 0``: the token the workers had to generate is dropped."""
    try:
        async for d in events:
            rs.completion_tokens = 0
            empty = () if d.logprobs is not None else None
            yield Delta("", 0, "length" if d.finish_reason else None, (), empty)
    finally:
        await events.aclose()  # aborts on the workers when unfinished


class Echo:
    """One request's prompt part: its text, its formatted logprobs, its vLLM entries."""

    def __init__(
        self,
        spec: EchoSpec,
        tokenizer: Any,
        prompt_text: str | None,
        rs: RequestState,
        logprobs: int | None,
        as_ids: bool = False,
    ) -> None:
        self.spec, self.tok, self.rs = spec, tokenizer, rs
        self.k = logprobs  # the completion's logprobs (None: off)
        self.as_ids = as_ids
        self._text = prompt_text

    @property
    def text(self) -> str:
        if not self.spec.echo:
            return ""
        if self._text is None:
            self._text = str(self.tok.decode(self.rs.prompt_ids))
        return self._text

    def entries(self) -> list[Any]:
        lps = self.rs.prompt_logprobs
        if lps is None or len(lps) != len(self.rs.prompt_ids):
            raise APIError(502, "the workers returned no prompt logprobs for this request")
        return lps

    def logprobs(self) -> dict[str, Any] | None:
        """The prompt's part of an echoed choice's ``logprobs`` (offsets from 0)."""
        if not self.spec.echo or self.k is None:
            return None
        fmt = LogprobsFormatter(self.tok, False, self.as_ids)
        tokens, lps, tops, offsets = [], [], [], []
        for token_id, entry in zip(self.rs.prompt_ids, self.entries(), strict=True):
            text = fmt.token(token_id)
            tokens.append(text)
            offsets.append(fmt.offset)
            fmt.offset += len(text)
            lps.append(None if entry is None else entry[0])
            tops.append(
                None if entry is None else {fmt.token(int(i)): lp for i, lp in entry[2][: self.k]}
            )
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def vllm(self) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: per position, the prompt token and the top K."""
        k = self.spec.prompt_logprobs
        if k is None:
            return None
        fmt = LogprobsFormatter(self.tok, False, self.as_ids)
        out: list[Any] = []
        for token_id, entry in zip(self.rs.prompt_ids, self.entries(), strict=True):
            if entry is None:
                out.append(None)
                continue
            logprob, rank, top = entry
            ranked = {int(i): (lp, r) for r, (i, lp) in enumerate(top[:k], 1)}
            ranked.setdefault(token_id, (logprob, rank))
            out.append(
                {
                    str(i): {"logprob": lp, "rank": r, "decoded_token": fmt.token(i)}
                    for i, (lp, r) in ranked.items()
                }
            )
        return out

    def shift(self, fmt: LogprobsFormatter | None) -> None:
        """The completion's text_offset continues after the echoed prompt."""
        if fmt is not None and self.spec.echo:
            fmt.offset = len(self.text)

    def whole(self, body: dict[str, Any]) -> dict[str, Any]:
        """A whole completion body with the prompt in front of its choice."""
        choice = body["choices"][0]
        choice["text"] = self.text + choice["text"]
        choice["logprobs"] = _joined(self.logprobs(), choice["logprobs"])
        if self.spec.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm()
        return body

    def head(self, rid: str, model: str) -> str:
        """The first chunk of a stream: the echoed prompt (text, logprobs) and vLLM's
        ``prompt_logprobs``."""
        choice = {"index": 0, "text": self.text, "logprobs": self.logprobs(), "finish_reason": None}
        if self.spec.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm()
        created = int(time.time())
        return openai_response.sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
        )


def _joined(prompt: dict[str, Any] | None, completion: dict[str, Any] | None) -> Any:
    if prompt is None:
        return completion
    if completion is None:
        return prompt
    return {key: prompt[key] + completion[key] for key in prompt}


def echo_for(tokenizer: Any, req: Any, rs: RequestState) -> Echo | None:
    """The prompt part of ``req``'s reply (a router CompletionRequest); None without echo."""
    spec = req.echo
    if spec is None:
        return None
    return Echo(spec, tokenizer, req.prompt_text, rs, req.sampling.logprobs, req.tokens_as_ids)
