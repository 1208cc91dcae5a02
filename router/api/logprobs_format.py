"""Token log-probabilities in OpenAI's two shapes.

The workers send, per generated token, ``[logprob, [[id, logprob], ...]]``; the
router names the tokens with its tokenizer (each token decoded alone, as vLLM
does: a token that is part of a multi-byte character reads as U+FFFD, its
``bytes`` are still exact for whole characters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.router.errors import APIError


class LogprobsFormatter:
    """Per request: keeps the running ``text_offset`` of completions across chunks."""

    def __init__(self, tokenizer: Any, chat: bool, as_ids: bool = False) -> None:
        self.tok = tokenizer
        self.chat = chat
        self.as_ids = as_ids  # vLLM's return_tokens_as_token_ids
        self.offset = 0

    def token(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        return str(self.tok.decode([token_id], skip_special_tokens=False))

    def format(self, ids: Sequence[int], logprobs: Sequence[Any]) -> dict[str, Any]:
        if len(ids) != len(logprobs):  # a worker bug; never misattribute a logprob
            raise APIError(502, f"a worker sent {len(ids)} tokens but {len(logprobs)} logprobs")
        return self._chat(ids, logprobs) if self.chat else self._completion(ids, logprobs)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chat(self, ids: Sequence[int], logprobs: Sequence[Any]) -> dict[str, Any]:
        content = []
        for token_id, (logprob, top) in zip(ids, logprobs, strict=True):
            entry = self._entry(token_id, logprob)
            entry["top_logprobs"] = [self._entry(int(i), lp) for i, lp in top]
            content.append(entry)
        return {"content": content}

    def _completion(self, ids: Sequence[int], logprobs: Sequence[Any]) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, (logprob, top) in zip(ids, logprobs, strict=True):
            text = self.token(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            tops.append({self.token(int(i)): lp for i, lp in top})
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
