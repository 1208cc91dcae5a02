"""LoRA affinity with real workers: ``pdserve up`` (1 prefill + 2 decode workers, tiny
model) serving 6 adapters, each worker holding at most 2 in memory (``--max-loras 2
--max-cpu-loras 2``), once with the router's default scorers (``lora-affinity`` on) and
once without it; the same requests (Zipf over the adapters, 4 at a time) through the
router each time. The hit ratio is the router's own count
(``pdserve_router_lora_routed_total{role="decode",resident}``: the picked decode worker
listed the adapter resident). The last stdout line is JSON.

    python bench/lora_routing_real.py [--requests 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from pdserve import env
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.testing.loopback import all_kv_free
from pdserve.testing.lora_adapters import ATTENTION, AdapterSpec, write_adapter
from pdserve.testing.up import port_base, running_up

ROOT = Path(__file__).resolve().parent.parent

ADAPTERS = 6
OFF = [
    "--router-arg=--decode-scorer=kv=1",
    "--router-arg=--decode-scorer=running=1",
    *(f"--router-arg=--scorer={p}" for p in ("prefix=2", "load=1", "balance=0.5")),
]


def routed(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_router_lora_routed_total{") and 'role="decode"' in line:
            out["true" if 'resident="true"' in line else "false"] = float(line.split()[-1])
    return out


async def send(url: str, names: list[str], seed: int) -> None:
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(names))]
    picks = [rng.choices(names, weights)[0] for _ in range(ARGS.requests)]
    sem = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=url, timeout=300) as h:

        async def one(i: int, name: str) -> None:
            async with sem:
                body = {
                    "model": name,
                    "prompt": [5 + (i * 7 + j) % 2000 for j in range(24)],
                    "max_tokens": 4,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = await h.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one(i, n) for i, n in enumerate(picks)))


def run(model: Path, dirs: dict[str, Path], logs: Path, extra: list[str]) -> dict[str, float]:
    flags = ["--prefill", "1", "--decode", "2", "--log-dir", str(logs), *port_base()]
    flags += ["--disagg-threshold", "8", "--worker-arg=--max-loras=2"]
    flags += ["--worker-arg=--max-cpu-loras=2", *extra]
    for name, path in dirs.items():
        flags += ["--lora", f"{name}={path}"]
    with running_up(model, *flags) as up:
        asyncio.run(send(up.url, list(dirs), ARGS.seed))
        got = routed(up.url)
        all_kv_free(up.workers)
        return got


def main() -> int:
    # one secret for pdserve up's processes and this script's signed /stats reads
    os.environ.setdefault(env.SERVICE_SECRET, secrets.token_hex(32))
    load_start = [round(x, 2) for x in os.getloadavg()]
    model = write_tiny_model(ROOT / ".cache" / "models" / "tiny-seed0", "tiny")
    result: dict[str, Any] = {
        "requests": ARGS.requests,
        "adapters": ADAPTERS,
        "decode_workers": 2,
        "resident_per_worker": 2,
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-routing-") as tmp:
        specs = [AdapterSpec(f"lora{i}", ATTENTION, 4, 8, 200 + i) for i in range(ADAPTERS)]
        dirs = {s.name: write_adapter(model, Path(tmp) / s.name, s) for s in specs}
        for mode, extra in (("on", []), ("off", OFF)):
            got = run(model, dirs, Path(tmp) / f"logs-{mode}", extra)
            total = sum(got.values())
            result[f"decode_hit_ratio_affinity_{mode}"] = got.get("true", 0.0) / max(total, 1)
            result[f"decode_routed_affinity_{mode}"] = total
    result["load_avg_start"] = load_start
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    sys.exit(main())
