"""``pdserve router``'s flags: the fields of these dataclasses (pdserve/config_cli.py).

``router/main.py`` turns the parsed flags into a :class:`RouterConfig` (per-process shares,
keys read, the model resolved); a new flag is a field here, with its help and group, and
``docs/cli.md`` is regenerated (``python -m pdserve.cli_docs > docs/cli.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config_cli import checked, flag
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

SERVE, WORKERS, KEYS, ROUTE, HEALTH = "serving", "workers", "keys", "routing", "health"


lora_flag = checked(parse_lora)
scorer_flag = checked(parse_scorer)


def _scorers(help: str) -> Any:
    """A pool's ``--scorer``-style flag: NAME=WEIGHT, repeated."""
    return flag((), help, group=ROUTE, metavar="NAME=WEIGHT", parse=scorer_flag, many="append")


def _pairs(pairs: tuple[tuple[str, float], ...]) -> str:
    return ", ".join(f"{n}={w:g}" for n, w in pairs)


@dataclass(frozen=True)
class RouterArgs:
    """Where the router serves, its workers, keys and routing."""

    model: str = flag(
        help="model dir (tokenizer + config) or FILE.gguf", group=SERVE, short=True, required=True
    )
    served_model_name: str = flag(
        "", "name clients use (default: dir name)", group=SERVE, short=True
    )
    host: str = flag("127.0.0.1", "address to bind", group=SERVE, short=True)
    port: int = flag(8000, "HTTP port", group=SERVE, short=True)
    procs: str = flag(
        "1",
        "router processes on the port (SO_REUSEPORT), each with the full "
        "view; 'auto': the CPU limit (docs/router.md)",
        group=SERVE,
        short=True,
    )
    log_level: str = flag("info", "logging level", group=SERVE, short=True)
    keep_alive_timeout: int = flag(
        CLIENT_KEEP_ALIVE_S,
        "seconds an idle client connection stays open (longer than "
        "clients and load balancers keep theirs: docs/router.md)",
        group=SERVE,
    )
    fast_lane: bool = flag(
        False,
        "serve POST /v1/completions (one choice, no logprobs) with the compiled lane "
        "(rust/router_lane/, built by scripts/setup.sh); every other request on the "
        "Python lane behind it; without the module the Python lane serves all, and says so",
        group=SERVE,
    )
    prefill: tuple[str, ...] = flag(
        (), "prefill worker URLs", group=WORKERS, short=True, metavar="URL", many="extend"
    )
    decode: tuple[str, ...] = flag(
        (), "decode worker URLs", group=WORKERS, short=True, metavar="URL", many="extend"
    )
    discovery: str = flag(
        "static",
        "static: --prefill/--decode or --workers-file; kubernetes: the LLMService's pods",
        group=WORKERS,
        short=True,
        choices=("static", "kubernetes"),
    )
    workers_file: str = flag(
        "",
        'JSON {"prefill": [URL], "decode": [URL]}, re-read on change '
        "(static discovery; used by pdserve up --autoscale)",
        group=WORKERS,
    )
    service: str = flag("", "LLMService name (kubernetes discovery)", group=WORKERS)
    namespace: str = flag("", "namespace (default: the pod's own)", group=WORKERS)
    api_key: str = flag(
        "", "required bearer key", group=KEYS, short=True, exclusive="api", env=env.API_KEY
    )
    api_key_file: str = flag(
        "",
        "file with one API key per line, optionally 'KEY priority=N'; re-read when it changes",
        group=KEYS,
        exclusive="api",
    )
    admin_api_key: str = flag(
        "",
        "key that opens /metrics and /workers while API keys are on",
        group=KEYS,
        exclusive="admin",
        env=env.ADMIN_API_KEY,
    )
    admin_api_key_file: str = flag("", "file of admin keys", group=KEYS, exclusive="admin")
    admin_port: int = flag(
        0,
        "a second port (on --host) where /metrics and /workers need no "
        "key; keep it off the tenants' network (0: none)",
        group=KEYS,
    )
    picker: str = flag(
        "max-score",
        "max-score: the best weighted score of the scorers; round-robin: rotation (a baseline)",
        group=ROUTE,
        short=True,
        choices=PICKERS,
    )
    disagg_threshold: int = flag(
        256, "uncached prompt tokens below which decode prefills locally", group=ROUTE, short=True
    )
    pd_handoff: str = flag(
        "router",
        "who calls the prefill worker: the router (then the decode "
        "worker with the KV handle), or the decode worker, named the prefill "
        "workers to use (one call per request at the router; docs/router.md)",
        group=ROUTE,
        choices=PD_HANDOFFS,
    )
    scorer: tuple[tuple[str, float], ...] = _scorers(
        f"a prefill scorer and its weight, repeated (default {_pairs(PREFILL_SCORERS)})"
    )
    decode_scorer: tuple[tuple[str, float], ...] = _scorers(
        f"a decode scorer (default {_pairs(DECODE_SCORERS)})"
    )
    prefill_filter: tuple[str, ...] = flag(
        (),
        f"a prefill filter, repeated, run in order; 'none': no filter (default "
        f"{', '.join(PREFILL_FILTERS)}; of {', '.join(FILTERS)})",
        group=ROUTE,
        metavar="NAME",
        many="append",
    )
    decode_filter: tuple[str, ...] = flag(
        (),
        f"a decode filter (default {', '.join(DECODE_FILTERS)})",
        group=ROUTE,
        metavar="NAME",
        many="append",
    )
    default_max_tokens: int = flag(16, "max_tokens of a request that names none", group=ROUTE)
    lora: tuple[tuple[str, str], ...] = flag(
        (),
        "a LoRA adapter served as model NAME (repeatable); its files are hashed here, and "
        "the workers get the same --lora",
        group=ROUTE,
        metavar="NAME=PATH",
        parse=lora_flag,
        many="append",
    )
    prefix_index_max_blocks: int = flag(
        1_000_000,
        "block hashes the prefix index remembers, "
        "all workers together; beyond them the least recently "
        "used are forgotten (~200 B each)",
        group=ROUTE,
    )
    prefix_tier_weights: str = flag(
        "host=0.8,disk=0.5,shared=0.3",
        "what a prefix hit in a prefill worker's KV tier is worth (the pool's is 1); "
        "a prefix in the shared tier is a hit on every prefill worker",
        group=ROUTE,
        metavar="TIER=WEIGHT,...",
    )
    health_interval: float = flag(1.0, "seconds between health checks", group=HEALTH)
    stall_timeout: float = flag(
        10.0,
        "seconds a decode stream or prefill may wait for a worker "
        "that fails its health check before it moves to another worker",
        group=HEALTH,
    )
    failover_wait: float = flag(
        30.0,
        "seconds a request whose decode workers all failed waits "
        "for one to come back (a restart) before it fails; 0: no wait",
        group=HEALTH,
    )


FLAGS = (RouterArgs, EdgeLimits, PickerArgs)
