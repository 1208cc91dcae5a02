"""N-gram prompt lookup: draft tokens read out of the request's own tokens, no model.

The last ``n`` tokens (prompt + output so far) are looked for earlier in the sequence,
longest ``n`` first (``max_n`` down to ``min_n``); at the most recent earlier occurrence,
the tokens that followed it are the draft, up to ``k``. Text that copies its input (code
edits, quotes from a document, a summary that repeats names) drafts well; open-ended text
rarely matches, and then nothing is proposed and the step is a plain decode.

The search is a vectorised filter over the sequence (one numpy comparison per suffix
position over the surviving candidates), O(length) per request per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, k: int, min_n: int = 2, max_n: int = 4) -> None:
        assert 1 <= min_n <= max_n and k >= 1
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: Sequence[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured k) draft tokens that continue ``tokens``."""
        k = self.k if k is None else min(k, self.k)
        n_tokens = len(tokens)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            start = find_last(arr, n)
            if start >= 0:
                return arr[start + n : start + n + k].tolist()  # type: ignore[no-any-return]
        return []


def find_last(arr: np.ndarray, n: int) -> int:
    """The last start ``i`` with ``arr[i:i+n] == arr[-n:]`` and at least one token after
    the match that is not part of the suffix itself (``i + n < len(arr)``); -1: none."""
    size = len(arr)
    suffix = arr[size - n :]
    cand = np.flatnonzero(arr[: size - n] == suffix[0])
    for j in range(1, n):
        if cand.size == 0:
            return -1
        cand = cand[arr[cand + j] == suffix[j]]
    return int(cand[-1]) if cand.size else -1
