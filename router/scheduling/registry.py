"""Every scorer by the name a configuration uses (``--scorer NAME=WEIGHT``): the one place
where a new scorer is added (like vLLM's connector factory; nothing registers itself on import)."""

from __future__ import annotations

from pdserve.router.scheduling import scorers
from pdserve.router.scheduling.scoring import Scorer

SCORERS: dict[str, Scorer] = {
    "prefix-match": scorers.prefix_match,
    "queued-tokens": scorers.queued_tokens,
    "running": scorers.running,
    "free-kv": scorers.free_kv,
    "cache-balance": scorers.cache_balance,
    "lora-affinity": scorers.lora_affinity,
}
