"""``pdserve router``'s flags: the fields of these dataclasses (pdserve/config_cli.py).

``router/main.py`` turns the parsed flags into a :class:`RouterConfig` (per-process shares,
keys read, the model resolved); a new flag is a field here, with its help and group, and
``docs/cli.md`` is regenerated (``python -m pdserve.cli_docs > docs/cli.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config_cli import checked, flag_group
from pdserve.router.adapters import parse_lora
from pdserve.router.config import (
    DECODE_FILTERS,
    DECODE_SCORERS,
    FILTERS,
    PD_HANDOFFS,
    PICKERS,
    PREFILL_FILTERS,
    PREFILL_SCORERS,
    parse_scorer,
)
from pdserve.router.edge_args import EdgeLimits, PickerArgs

# Seconds an idle client connection stays open. uvicorn's default, 5 s, equals httpx's
# pool expiry (the OpenAI SDK's) and is below aiohttp's 15 s: a client reused connections
# the router was closing at that moment and the request failed ("Server disconnected":
# 3 of 160 requests of a client pausing ~5 s between bursts, here). Longer than common client pools
# (Go's 90 s) and load balancers' idle timeouts (60 s), so the client side gives up first.
CLIENT_KEEP_ALIVE_S = 120

flag_serve = flag_group("serving")
flag_workers = flag_group("workers")
flag_keys = flag_group("keys")
flag_route = flag_group("routing")
flag_health = flag_group("health")


lora_flag = checked(parse_lora)
scorer_flag = checked(parse_scorer)


def _scorers(help: str) -> Any:
    """A pool's ``--scorer``-style flag: NAME=WEIGHT, repeated."""
    return flag_route((), help, metavar="NAME=WEIGHT", parse=scorer_flag, many="append")


def _worker_urls(role: str) -> Any:
    """``--prefill`` / ``--decode``: a role's static worker URLs, listed after the flag."""
    return flag_workers((), f"{role} worker URLs", short=True, metavar="URL", many="extend")


def _pairs(pairs: tuple[tuple[str, float], ...]) -> str:
    return ", ".join(f"{n}={w:g}" for n, w in pairs)


@dataclass(frozen=True)
class RouterArgs:
    """Where the router serves, its workers, keys and routing."""

    model: str = flag_serve(
        help="model dir (tokenizer + config) or FILE.gguf", short=True, required=True
    )
    served_model_name: str = flag_serve("", "name clients use (default: dir name)", short=True)
    host: str = flag_serve("127.0.0.1", "address to bind", short=True)
    port: int = flag_serve(8000, "HTTP port", short=True)
    procs: str = flag_serve(
        "1",
        "router processes on the port (SO_REUSEPORT), each with the full "
        "view; 'auto': the CPU limit (docs/router.md)",
        short=True,
    )
    log_level: str = flag_serve("info", "logging level", short=True)
    keep_alive_timeout: int = flag_serve(
        CLIENT_KEEP_ALIVE_S,
        "seconds an idle client connection stays open (longer than "
        "clients and load balancers keep theirs: docs/router.md)",
    )
    fast_lane: bool = flag_serve(
        False,
        "serve POST /v1/completions (one choice, no logprobs) with the compiled lane "
        "(rust/router_lane/, built by scripts/setup.sh); every other request on the "
        "Python lane behind it; without the module the Python lane serves all, and says so",
    )
    prefill: tuple[str, ...] = _worker_urls("prefill")
    decode: tuple[str, ...] = _worker_urls("decode")
    discovery: str = flag_workers(
        "static",
        "static: --prefill/--decode or --workers-file; kubernetes: the LLMService's pods",
        short=True,
        choices=("static", "kubernetes"),
    )
    workers_file: str = flag_workers(
        "",
        'JSON {"prefill": [URL], "decode": [URL]}, re-read on change '
        "(static discovery; used by pdserve up --autoscale)",
    )
    service: str = flag_workers("", "LLMService name (kubernetes discovery)")
    namespace: str = flag_workers("", "namespace (default: the pod's own)")
    api_key: str = flag_keys(
        "", "required bearer key", short=True, exclusive="api", env=env.API_KEY
    )
    api_key_file: str = flag_keys(
        "",
        "file with one API key per line, optionally 'KEY priority=N'; re-read when it changes",
        exclusive="api",
    )
    admin_api_key: str = flag_keys(
        "",
        "key that opens /metrics and /workers while API keys are on",
        exclusive="admin",
        env=env.ADMIN_API_KEY,
    )
    admin_api_key_file: str = flag_keys("", "file of admin keys", exclusive="admin")
    admin_port: int = flag_keys(
        0,
        "a second port (on --host) where /metrics and /workers need no "
        "key; keep it off the tenants' network (0: none)",
    )
    picker: str = flag_route(
        "max-score",
        "max-score: the best weighted score of the scorers; round-robin: rotation (a baseline)",
        short=True,
        choices=PICKERS,
    )
    disagg_threshold: int = flag_route(
        256, "uncached prompt tokens below which decode prefills locally", short=True
    )
    pd_handoff: str = flag_route(
        "router",
        "who calls the prefill worker: the router (then the decode "
        "worker with the KV handle), or the decode worker, named the prefill "
        "workers to use (one call per request at the router; docs/router.md)",
        choices=PD_HANDOFFS,
    )
    scorer: tuple[tuple[str, float], ...] = _scorers(
        f"a prefill scorer and its weight, repeated (default {_pairs(PREFILL_SCORERS)})"
    )
    decode_scorer: tuple[tuple[str, float], ...] = _scorers(
        f"a decode scorer (default {_pairs(DECODE_SCORERS)})"
    )
    prefill_filter: tuple[str, ...] = flag_route(
        (),
        f"a prefill filter, repeated, run in order; 'none': no filter (default "
        f"{', '.join(PREFILL_FILTERS)}; of {', '.join(FILTERS)})",
        metavar="NAME",
        many="append",
    )
    decode_filter: tuple[str, ...] = flag_route(
        (),
        f"a decode filter (default {', '.join(DECODE_FILTERS)})",
        metavar="NAME",
        many="append",
    )
    default_max_tokens: int = flag_route(16, "max_tokens of a request that names none")
    lora: tuple[tuple[str, str], ...] = flag_route(
        (),
        "a LoRA adapter served as model NAME (repeatable); its files are hashed here, and "
        "the workers get the same --lora",
        metavar="NAME=PATH",
        parse=lora_flag,
        many="append",
    )
    prefix_index_max_blocks: int = flag_route(
        1_000_000,
        "block hashes the prefix index remembers, "
        "all workers together; beyond them the least recently "
        "used are forgotten (~200 B each)",
    )
    prefix_tier_weights: str = flag_route(
        "host=0.8,disk=0.5,shared=0.3",
        "what a prefix hit in a prefill worker's KV tier is worth (the pool's is 1); "
        "a prefix in the shared tier is a hit on every prefill worker",
        metavar="TIER=WEIGHT,...",
    )
    health_interval: float = flag_health(1.0, "seconds between health checks")
    stall_timeout: float = flag_health(
        10.0,
        "seconds a decode stream or prefill may wait for a worker "
        "that fails its health check before it moves to another worker",
    )
    failover_wait: float = flag_health(
        30.0,
        "seconds a request whose decode workers all failed waits "
        "for one to come back (a restart) before it fails; 0: no wait",
    )


FLAGS = (RouterArgs, EdgeLimits, PickerArgs)
