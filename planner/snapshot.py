"""The planner's input: one interval of metrics, as a frozen snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LatencyStats:
    """A latency distribution over one interval (seconds); ``count`` samples."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    attainment: float = 1.0  # fraction of samples within the SLO target


@dataclass(frozen=True)
class PoolStatus:
    """Replica counts of one pool, as Kubernetes (or local mode) reports them.

    ``current`` is the desired count on the Deployment (spec), ``ready`` the pods
    serving, ``pending`` the pods that cannot be scheduled (no free accelerator).
    The rest (``current - ready - pending``) are starting up.
    """

    current: int
    ready: int
    pending: int = 0

    def __post_init__(self) -> None:
        if min(self.current, self.ready, self.pending) < 0:
            raise ValueError(f"replica counts must be >= 0, got {self}")

    @property
    def unready(self) -> int:
        return max(0, self.current - self.ready)

    @property
    def starting(self) -> int:
        return max(0, self.current - self.ready - self.pending)


@dataclass(frozen=True)
class MetricsSnapshot:
    """What the planner sees each interval. Rates are per second over the interval."""

    time_s: float  # when the interval ended (any monotonic clock, same as the state's)
    interval_s: float
    prefill: PoolStatus
    decode: PoolStatus
    ttft: LatencyStats = field(default_factory=LatencyStats)
    tpot: LatencyStats = field(default_factory=LatencyStats)
    itl: LatencyStats = field(default_factory=LatencyStats)
    request_rate: float = 0.0  # requests arriving per second
    prompt_token_rate: float = 0.0  # prompt tokens arriving per second
    output_token_rate: float = 0.0  # generated tokens per second
    cached_token_fraction: float = 0.0  # share of prompt tokens served from the prefix cache
    prefill_queue_depth: float = 0.0  # requests waiting for prefill (router + workers)
    prefill_queue_wait_s: float = 0.0  # mean wait before prefill started, this interval
    decode_running: float = 0.0  # sequences in decode batches (all replicas)
    decode_waiting: float = 0.0  # sequences waiting for a decode slot
    kv_utilisation: float = 0.0  # used / total KV blocks over the decode pool

    @property
    def mean_prompt_tokens(self) -> float:
        return self.prompt_token_rate / self.request_rate if self.request_rate > 0 else 0.0

    @property
    def mean_output_tokens(self) -> float:
        return self.output_token_rate / self.request_rate if self.request_rate > 0 else 0.0
