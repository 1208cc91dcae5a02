"""Router configuration: one frozen dataclass, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

ROUTING_MODES = ("prefix", "round-robin")
CACHE_ISOLATION = ("api-key", "none")  # a prefix-cache salt per API key, or one shared cache


@dataclass(frozen=True)
class ScorerWeight:
    """One scorer plugin (by registry key) and its weight in the weighted sum."""

    name: str
    weight: float


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str
    served_model_name: str = ""
    routing: str = "prefix"  # "prefix" | "round-robin"
    # Prompts whose uncached part is shorter than this go straight to a decode worker.
    disagg_threshold: int = 256
    prefix_weight: float = 2.0
    load_weight: float = 1.0
    balance_weight: float = 0.5
    decode_kv_weight: float = 1.0
    decode_load_weight: float = 1.0
    max_queue: int = 256  # requests in flight in the router; beyond it 429
    api_keys: tuple[str, ...] = ()
    health_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    prefix_index_capacity: int = 1_000_000  # block hashes remembered, all workers together
    default_max_tokens: int = 16
    # Limits at the edge (router/edge.py, router/ratelimit.py); see docs/router.md.
    max_body_bytes: int = 8 << 20
    max_prompt_chars: int = 1 << 20
    tokenizer_threads: int = 2
    rate_limit_rpm: int = 0  # requests per minute per API key; 0: no limit
    rate_limit_tpm: int = 0  # prompt + max_tokens per minute per API key; 0: no limit
    cache_isolation: str = "api-key"

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"unknown routing mode {self.routing!r}; valid: {list(ROUTING_MODES)}")
        if self.disagg_threshold < 0:
            raise ValueError("disagg_threshold must be >= 0")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(f"cache_isolation must be one of {list(CACHE_ISOLATION)}")
        for name in ("max_body_bytes", "max_prompt_chars", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.rate_limit_rpm < 0 or self.rate_limit_tpm < 0:
            raise ValueError("rate limits must be >= 0 (0: no limit)")
        for name in (
            "prefix_weight",
            "load_weight",
            "balance_weight",
            "decode_kv_weight",
            "decode_load_weight",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.rstrip("/").split("/")[-1]

    @property
    def prefill_scorers(self) -> tuple[ScorerWeight, ...]:
        return (
            ScorerWeight("prefix-match", self.prefix_weight),
            ScorerWeight("queued-tokens", self.load_weight),
            ScorerWeight("running", self.load_weight),
            ScorerWeight("cache-balance", self.balance_weight),
        )

    @property
    def decode_scorers(self) -> tuple[ScorerWeight, ...]:
        return (
            ScorerWeight("free-kv", self.decode_kv_weight),
            ScorerWeight("running", self.decode_load_weight),
        )
