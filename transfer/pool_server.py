"""A standalone prefill-side KV server over a synthetic pool, for tests and benchmarks.

``python -m pdserve.transfer.pool_server --transport nixl --blocks 64 ...`` fills a pool with
deterministic bytes (``fill_pool``), starts a ``KVServer`` on 127.0.0.1 (free port), prints one
JSON line ``{"agent_name", "side_channel", "num_bytes"}``, then one ``{"released": id}`` line per
ended lease. Each stdin line ``{"hold": id, "block_ids": [...], "num_tokens": n}`` starts a
lease and is answered with ``{"handle": <KVHandle codec form>}``. Exits when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

import torch

from pdserve.protocol.codec import to_dict
from pdserve.transfer.messages import CompatRecord
from pdserve.transfer.registry import DEFAULT_LEASE_SECONDS
from pdserve.transfer.server import KVServer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pool_shape(args: argparse.Namespace) -> tuple[int, ...]:
    return (args.layers, 2, args.blocks, args.block_size, args.kv_heads, args.head_dim)


def fill_pool(pool: torch.Tensor, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes (any dtype; compare pools by bytes, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    cpu = torch.empty(pool.shape, dtype=pool.dtype)
    cpu.view(torch.int16).random_(-(2**15), 2**15, generator=gen)
    pool.copy_(cpu)
    return pool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="nixl")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="test-model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_SECONDS)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    pool = torch.empty(pool_shape(args), dtype=DTYPES[args.dtype], device=args.device)
    fill_pool(pool, args.seed)
    compat = CompatRecord.for_pool(pool, args.model)
    server = KVServer(pool, compat, transport=args.transport, lease_seconds=args.lease_seconds)
    info = {"agent_name": server.agent_name, "side_channel": server.side_channel}
    print(json.dumps({**info, "num_bytes": pool.numel() * pool.element_size()}), flush=True)
    stdin_closed = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            handle = server.make_handle(cmd["hold"], cmd["block_ids"], cmd["num_tokens"], [])
            print(json.dumps({"handle": to_dict(handle)}), flush=True)
        stdin_closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not stdin_closed.is_set():
        rid = server.wait_released(0.05)
        if rid is not None:
            print(json.dumps({"released": rid}), flush=True)
    server.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
