"""The prefill/decode decision: remote prefill only when it saves enough work.

Sending a prompt to a prefill worker costs a KV transfer and an extra hop; it
pays only when the part of the prompt the decode worker would have to compute
itself is long. Below ``threshold`` uncached tokens, the decode worker prefills
locally.
"""

from __future__ import annotations

REMOTE_PREFILL = "remote_prefill"
LOCAL_PREFILL = "local_prefill"


def decide(
    num_prompt_tokens: int, decode_cached_tokens: int, threshold: int, have_prefill: bool
) -> str:
    """``remote_prefill`` or ``local_prefill`` for a prompt.

    ``decode_cached_tokens`` is how much of the prompt the chosen decode worker
    already holds (0 when unknown).
    """
    assert num_prompt_tokens >= 0 and decode_cached_tokens >= 0 and threshold >= 0
    if not have_prefill:
        return LOCAL_PREFILL
    uncached = num_prompt_tokens - min(decode_cached_tokens, num_prompt_tokens)
    return LOCAL_PREFILL if uncached < threshold else REMOTE_PREFILL
