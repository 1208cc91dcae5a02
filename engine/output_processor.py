"""From sampled tokens to what a caller sees: stop rules, detokenization, RequestOutputs.

One ``TextStream`` per live request (incremental detokenizer and stop strings,
engine/detokenizer.py). Each sampled token is checked against the request's stop rules
in a fixed order: a stop token id or EOS (past ``min_tokens``), then a stop string in the
text, then the length limits (``max_tokens``, the model's context). The processor decides;
the engine carries out (frees blocks, hands KV off), so nothing here touches blocks or
queues.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.engine import prompt_logprobs
from pdserve.engine.detokenizer import TextStream
from pdserve.engine.request import Request, RequestStatus
from pdserve.protocol.outputs import RequestOutput


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.streams: dict[str, TextStream] = {}

    def add(self, request_id: str, text: TextStream) -> None:
        self.streams[request_id] = text

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def check_stop(self, req: Request, token: int) -> tuple[RequestStatus | None, str]:
        """``token`` was just appended to ``req``'s outputs: the finish status it causes
        (None: the request goes on) and the text to send with it."""
        p = req.params
        text = self.streams[req.request_id]
        if token in p.stop_token_ids or (
            token in self.eos_token_ids
            and not p.ignore_eos
            and req.num_output_tokens > p.min_tokens
        ):
            return RequestStatus.FINISHED_STOPPED, text.finish().text
        delta = text.append([token])
        if delta.stop is not None:
            return RequestStatus.FINISHED_STOPPED, delta.text
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, delta.text + text.finish().text
        return None, delta.text

    def banned(self, req: Request) -> list[int]:
        """Token ids the sampler may not draw for ``req`` now (its stops, before
        ``min_tokens``)."""
        if req.num_output_tokens < req.params.min_tokens and not req.params.ignore_eos:
            return sorted(self.eos_token_ids | set(req.params.stop_token_ids))
        return []


def make_output(req: Request, token_ids: list[int], text: str, finish: str | None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        token_ids=token_ids,
        text=text,
        finish_reason=finish,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        error=req.error,
        error_code=req.error_code,
        queue_seconds=(
            req.first_scheduled_time - req.arrival_time
            if req.first_scheduled_time is not None and req.num_output_tokens <= 1
            else None
        ),
    )


def with_logprobs(out: RequestOutput, req: Request, lp: Any) -> RequestOutput:
    """The sampled token's logprobs, and the prompt's on the request's first output."""
    prompt = prompt_logprobs.take(req)
    if lp is None and prompt is None:
        return out
    return replace(out, logprobs=[lp] if lp is not None else None, prompt_logprobs=prompt)


def eos_ids(tokenizer: Any, hf_config: Any) -> set[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    return ids
