"""Every scheduling plugin by the name a configuration uses: scorers (``--scorer
NAME=WEIGHT``), filters (``--prefill-filter``/``--decode-filter``) and pickers
(``--picker``). The one place where a new plugin is added (like vLLM's connector factory;
nothing registers itself on import). An unknown name is refused with the valid ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pdserve.router.scheduling import filters, pickers, scorers
from pdserve.router.scheduling.pickers import Picker
from pdserve.router.scheduling.route_request import Filter, Scorer

SCORERS: dict[str, Scorer] = {
    "prefix-match": scorers.prefix_match,
    "queued-tokens": scorers.queued_tokens,
    "running": scorers.running,
    "free-kv": scorers.free_kv,
    "cache-balance": scorers.cache_balance,
    "lora-affinity": scorers.lora_affinity,
}
FILTERS: dict[str, Filter] = {
    "knows-lora": filters.knows_lora,
    "fits-kv": filters.fits_kv,
}
PICKERS: dict[str, Picker] = {
    "max-score": Picker(pickers.max_score, scores=True),
    "round-robin": Picker(pickers.round_robin, scores=False),
}

T = TypeVar("T")


def _get(kind: str, table: Mapping[str, T], name: str) -> T:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(table)}")
    return table[name]


def get_scorer(name: str) -> Scorer:
    return _get("scorer", SCORERS, name)


def get_filter(name: str) -> Filter:
    return _get("filter", FILTERS, name)


def get_picker(name: str) -> Picker:
    return _get("picker", PICKERS, name)
