"""``--speculative``: which proposer drafts tokens for the decode step, and how many.

Torch-free (the front ends parse it). Forms::

    ngram:k=4                  prompt lookup (engine/ngram_proposer.py), up to 4 drafts
    ngram:k=4,min_n=1,max_n=3  the n-gram lengths matched, longest first
    draft:model=PATH,k=4       a draft model sharing the target's tokenizer
                               (engine/draft_proposer.py): greedy drafts, up to 4

Every error is a ``ValueError`` that names the field (``speculative``) and the key.
"""

from __future__ import annotations

from dataclasses import dataclass

FIELD = "speculative"
MAX_K = 16  # drafts per step at most: a longer verification is mostly wasted on rejection
NGRAM_KEYS = {"k", "min_n", "max_n"}
DRAFT_KEYS = {"model", "k"}


@dataclass(frozen=True)
class SpecConfig:
    method: str  # "ngram" or "draft"
    k: int = 4  # draft tokens per step at most
    min_n: int = 2  # shortest suffix matched (ngram)
    max_n: int = 4  # longest suffix matched, tried first (ngram)
    model: str = ""  # the draft model's HF directory (draft)


def parse_speculative(value: str | None) -> SpecConfig | None:
    """The speculative config of ``value`` (None or "" or "off": no speculation)."""
    if value is None or value.strip() in ("", "off", "none"):
        return None
    method, _, rest = value.strip().partition(":")
    if method == "draft":
        return _draft(value, _options(value, rest))
    if method != "ngram":
        raise ValueError(
            f"{FIELD}: unknown method {method!r} in {value!r}; "
            "expected ngram:k=N or draft:model=PATH,k=N"
        )
    opts = _options(value, rest)
    unknown = sorted(set(opts) - NGRAM_KEYS)
    if unknown:
        raise ValueError(
            f"{FIELD}: unknown key {unknown[0]!r} in {value!r} (ngram takes k, min_n, max_n)"
        )
    ints = {key: _int(value, key, v) for key, v in opts.items()}
    cfg = SpecConfig("ngram", ints.get("k", 4), ints.get("min_n", 2), ints.get("max_n", 4))
    if not 1 <= cfg.k <= MAX_K:
        raise ValueError(f"{FIELD}: k must be in [1, {MAX_K}], got {cfg.k} in {value!r}")
    if not 1 <= cfg.min_n <= cfg.max_n:
        raise ValueError(f"{FIELD}: need 1 <= min_n <= max_n, got {value!r}")
    return cfg


def _draft(value: str, opts: dict[str, str]) -> SpecConfig:
    """``draft:model=PATH,k=N``: the model is checked when the engine loads it (its
    directory, its tokenizer against the target's: engine/draft_proposer.py)."""
    unknown = sorted(set(opts) - DRAFT_KEYS)
    if unknown:
        raise ValueError(f"{FIELD}: unknown key {unknown[0]!r} in {value!r} (draft takes model, k)")
    if not opts.get("model"):
        raise ValueError(f"{FIELD}: draft needs model=PATH (an HF directory) in {value!r}")
    cfg = SpecConfig("draft", k=_int(value, "k", opts.get("k", "4")), model=opts["model"])
    if not 1 <= cfg.k <= MAX_K:
        raise ValueError(f"{FIELD}: k must be in [1, {MAX_K}], got {cfg.k} in {value!r}")
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
