"""Router configuration: one frozen dataclass, built once from the command line."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.router.scheduling import registry
from pdserve.router.scheduling.profile import Profile, build_profile
from pdserve.router.scheduling.route_request import ScorerWeight
from pdserve.router.scheduling.tier_index import parse_weights

PICKERS = tuple(registry.PICKERS)  # max-score: best weighted score; round-robin: a baseline
FILTERS = tuple(registry.FILTERS)
PD_HANDOFFS = ("router", "decode")  # who calls the prefill worker (RouterConfig.pd_handoff)
CACHE_ISOLATION = ("api-key", "none")  # a prefix-cache salt per API key, or one shared cache

# Short names of ``--scorer NAME=WEIGHT`` for scorers that share one weight; any scorer's
# registry name (router/scheduling/registry.py) works as well.
SCORER_GROUPS: dict[str, tuple[str, ...]] = {
    "prefix": ("prefix-match",),
    "load": ("queued-tokens", "running"),
    "balance": ("cache-balance",),
    "kv": ("free-kv",),
    "lora": ("lora-affinity",),
}
# lora-affinity is 0 on every worker for a base-model request, so it only orders workers
# for requests that name an adapter (a worker holding it resident skips its load). On
# decode its 0.5 equals the running score's gap between 0 and 8 running requests: a
# resident adapter does not pull streams onto a crowded worker.
PREFILL_SCORERS = (("prefix", 2.0), ("load", 1.0), ("balance", 0.5), ("lora", 1.0))
DECODE_SCORERS = (("kv", 1.0), ("running", 1.0), ("lora", 0.5))
# Filters by registry name, run in order: a worker one drops is a retry of last resort.
PREFILL_FILTERS = ("knows-lora",)
DECODE_FILTERS = ("knows-lora", "fits-kv")


def parse_scorer(text: str) -> tuple[str, float]:
    """``NAME=WEIGHT`` (a ``--scorer`` value) → (name, weight), with a clear error."""
    name, sep, weight = text.partition("=")
    try:
        value = float(weight) if sep else -1.0
    except ValueError:
        value = -1.0
    if not name or value < 0:
        raise ValueError(f"scorer {text!r}: expected NAME=WEIGHT with a weight >= 0")
    return name, value


def filters(names: Sequence[str], default: tuple[str, ...]) -> tuple[str, ...]:
    """``--prefill-filter``/``--decode-filter`` values → filter names: none given, the
    default; ``none`` alone, no filter (the names are checked when the config is built)."""
    if not names:
        return default
    if list(names) == ["none"]:
        return ()
    return tuple(names)


def expand(pairs: Sequence[tuple[str, float]]) -> tuple[ScorerWeight, ...]:
    """Named weights → one ``ScorerWeight`` per registry scorer (groups expanded; a later
    pair for the same scorer wins), checking every name against the scorer registry."""
    out: dict[str, float] = {}
    for name, weight in pairs:
        for scorer in SCORER_GROUPS.get(name, (name,)):
            try:
                registry.get_scorer(scorer)
            except ValueError as exc:
                raise ValueError(f"{exc}; or a group: {sorted(SCORER_GROUPS)}") from None
            out[scorer] = weight
    return tuple(ScorerWeight(n, w) for n, w in out.items())


@dataclass(frozen=True)
class RouterConfig:
    model_dir: str
    served_model_name: str = ""
    picker: str = "max-score"  # PICKERS, both pools
    # Prompts whose uncached part is shorter than this go straight to a decode worker.
    disagg_threshold: int = 256
    scorers: tuple[tuple[str, float], ...] = PREFILL_SCORERS  # prefill (name, weight) pairs
    decode_scorer_weights: tuple[tuple[str, float], ...] = DECODE_SCORERS
    prefill_filters: tuple[str, ...] = PREFILL_FILTERS  # registry names, in order
    decode_filters: tuple[str, ...] = DECODE_FILTERS
    max_queue: int = 256  # requests in flight in the router; beyond them requests wait
    api_keys: tuple[str, ...] = ()
    api_key_file: str = ""  # KEY [priority=N] lines, re-read on change (router/api_keys.py)
    admin_api_keys: tuple[str, ...] = ()  # open /workers and /metrics while keys are on
    admin_api_key_file: str = ""
    admin_port: int = 0  # requests arriving on it open /metrics and /workers without a key
    # ``--procs N`` (router/procs.py): this process's index and every process's loopback
    # metrics port (a scrape of any process returns all of them); () with one process.
    proc_index: int = 0
    proc_metrics_ports: tuple[int, ...] = ()
    # Tenants (router/admission.py): a body must be in within body_timeout_s before its
    # request is admitted; one client holds at most max_concurrency_per_key (0: no cap)
    # requests; beyond max_queue, up to max_waiting wait queue_timeout_s, fairly by client.
    body_timeout_s: float = 30.0
    max_concurrency_per_key: int = 0
    # Router replicas splitting the per-client budgets (router/discovery/replicas.py): a
    # fixed count, or the ready endpoints of the router's own Service when one is named.
    router_replicas: int = 1
    router_service: str = ""
    router_namespace: str = ""
    # Exact per-key budgets across replicas (router/peer_budgets.py): every replica's base
    # URL (this one's is budget_self), or ("kubernetes",): the router Service's endpoints.
    budget_peers: tuple[str, ...] = ()
    budget_self: str = ""
    max_waiting: int = 256
    queue_timeout_s: float = 30.0
    # A stream whose client has not taken a chunk for this long is aborted (slow reader).
    stream_write_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    # A call to a worker (decode stream, prefill) this long without bytes, on a worker whose
    # health check fails, is cut and moves to another worker (Dispatcher.cut_stalled).
    stall_timeout_s: float = 10.0
    # When every decode candidate failed, a request waits this long for a healthy decode
    # worker (a restarted one) before it fails (502 mid-stream, 503 before); 0: no wait.
    failover_wait_s: float = 30.0
    prefix_index_capacity: int = 1_000_000  # block hashes remembered, all workers together
    # what a prefix hit in a prefill worker's KV tier is worth against one in its pool (1)
    prefix_tier_weights: str = "host=0.8,disk=0.5,shared=0.3"
    default_max_tokens: int = 16
    # Limits at the edge (router/edge.py, router/ratelimit.py); see docs/router.md.
    max_body_bytes: int = 8 << 20
    max_prompt_chars: int = 1 << 20
    max_schema_bytes: int = (
        64 << 10
    )  # a structured-output spec's JSON (router/api/grammar_limits.py)
    tokenizer_threads: int = 2
    rate_limit_rpm: int = 0  # requests per minute per API key; 0: no limit
    rate_limit_tpm: int = 0  # prompt + max_tokens per minute per API key; 0: no limit
    cache_isolation: str = "api-key"
    # The decode pod's front in endpoint-picker mode (router/picker/prefill_header.py): the
    # prefill worker is the one the picker named in a signed header, else local prefill.
    prefill_from_header: bool = False
    # Who calls the prefill worker on the P/D path (router/transport/dispatch.py): "router"
    # (the router, then the decode worker with the KV handle) or "decode" (the decode worker,
    # named the prefill workers to use: one worker call per request at the router).
    pd_handoff: str = "router"
    # LoRA adapters (--lora NAME=PATH), served as models of that name (router/adapters.py)
    loras: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.pd_handoff not in PD_HANDOFFS:
            raise ValueError(f"unknown pd_handoff {self.pd_handoff!r}; valid: {list(PD_HANDOFFS)}")
        if self.disagg_threshold < 0:
            raise ValueError("disagg_threshold must be >= 0")
        if self.failover_wait_s < 0:
            raise ValueError("failover_wait_s must be >= 0")
        if self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be > 0")
        if self.max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise ValueError(f"cache_isolation must be one of {list(CACHE_ISOLATION)}")
        for name in ("max_body_bytes", "max_prompt_chars", "max_schema_bytes", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("body_timeout_s", "queue_timeout_s", "stream_write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.router_replicas < 1:
            raise ValueError("router_replicas (--router-replicas) must be >= 1")
        if self.max_concurrency_per_key < 0 or self.max_waiting < 0:
            raise ValueError("max_concurrency_per_key and max_waiting must be >= 0")
        parse_weights(self.prefix_tier_weights)  # a bad weight fails here, by flag name
        if self.prefix_index_capacity < 1:
            raise ValueError("prefix_index_capacity (--prefix-index-max-blocks) must be >= 1")
        if self.rate_limit_rpm < 0 or self.rate_limit_tpm < 0:
            raise ValueError("rate limits must be >= 0 (0: no limit)")
        for _, weight in (*self.scorers, *self.decode_scorer_weights):
            if weight < 0:
                raise ValueError("scorer weights must be >= 0")
        self.prefill_profile, self.decode_profile  # noqa: B018 - unknown names fail here

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.rstrip("/").split("/")[-1]

    @functools.cached_property  # read on every request; the config never changes
    def prefill_scorers(self) -> tuple[ScorerWeight, ...]:
        return expand(self.scorers)

    @functools.cached_property
    def decode_scorers(self) -> tuple[ScorerWeight, ...]:
        return expand(self.decode_scorer_weights)

    @functools.cached_property
    def prefill_profile(self) -> Profile:
        """The prefill pool's filters, scorers and picker (router/scheduling/profile.py)."""
        return build_profile(self.prefill_filters, self.prefill_scorers, self.picker)

    @functools.cached_property
    def decode_profile(self) -> Profile:
        return build_profile(self.decode_filters, self.decode_scorers, self.picker)

    @functools.cached_property
    def uses_prefix(self) -> bool:
        """Whether routing reads the prefix index (block hashes are computed for it)."""
        return self.prefill_profile.reads("prefix-match")
