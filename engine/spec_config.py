"""``--speculative``: which proposer drafts tokens for the decode step, and how many.

Torch-free (the front ends parse it). Forms::

    ngram:k=4                  prompt lookup (engine/ngram_proposer.py), up to 4 drafts
    ngram:k=4,min_n=1,max_n=3  the n-gram lengths matched, longest first
    draft:model=PATH,k=4       a draft model: not yet supported, refused by name

Every error is a ``ValueError`` that names the field (``speculative``) and the key.
"""

from __future__ import annotations

from dataclasses import dataclass

FIELD = "speculative"
MAX_K = 16  # drafts per step at most: a longer verification is mostly wasted on rejection
NGRAM_KEYS = {"k", "min_n", "max_n"}


@dataclass(frozen=True)
class SpecConfig:
    method: str  # "ngram"
    k: int = 4  # draft tokens per step at most
    min_n: int = 2  # shortest suffix matched
    max_n: int = 4  # longest suffix matched (tried first)


def parse_speculative(value: str | None) -> SpecConfig | None:
    """The speculative config of ``value`` (None or "" or "off": no speculation)."""
    if value is None or value.strip() in ("", "off", "none"):
        return None
    method, _, rest = value.strip().partition(":")
    if method == "draft":
        raise ValueError(
            f"{FIELD}: the draft-model proposer ({value!r}) is not yet supported; "
            "use ngram:k=N (prompt lookup)"
        )
    if method != "ngram":
        raise ValueError(f"{FIELD}: unknown method {method!r} in {value!r}; expected ngram:k=N")
    opts = _options(value, rest)
    unknown = sorted(set(opts) - NGRAM_KEYS)
    if unknown:
        raise ValueError(
            f"{FIELD}: unknown key {unknown[0]!r} in {value!r} (ngram takes k, min_n, max_n)"
        )
    cfg = SpecConfig("ngram", **{key: _int(value, key, v) for key, v in opts.items()})
    if not 1 <= cfg.k <= MAX_K:
        raise ValueError(f"{FIELD}: k must be in [1, {MAX_K}], got {cfg.k} in {value!r}")
    if not 1 <= cfg.min_n <= cfg.max_n:
        raise ValueError(f"{FIELD}: need 1 <= min_n <= max_n, got {value!r}")
    return cfg


def _options(value: str, rest: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, v = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{FIELD}: expected key=value, got {part!r} in {value!r}")
        out[key.strip()] = v.strip()
    return out


def _int(value: str, key: str, v: str) -> int:
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{FIELD}: {key} must be an integer, got {v!r} in {value!r}") from None
