"""KV transfer speed: NIXL vs the tcp transport vs an in-process torch copy, in one run.

Moves the KV of one prompt (default 4,096 tokens, 32 layers, 8 KV heads, head dim 128,
bfloat16, block 16 → 256 blocks, 512 MiB) from a prefill-side process
(``pdserve.transfer.pool_server``) into this process's pool through ``RemoteKVConnector``,
timing start_load → poll() result, and compares with ``index_select`` of the same blocks
into a second tensor in one process. The request's blocks are runs of 16 consecutive blocks
in shuffled order on each side (a fragmented, realistic allocation). Each transfer is checked
byte for byte. The last stdout line is JSON:
``{"nixl_gbps", "tcp_gbps", "memcpy_gbps", "nixl_vs_memcpy", "nixl_vs_tcp", ...}``.

    python bench/kv_transfer.py            # full size (about a minute)
    python bench/kv_transfer.py --quick    # tiny shape, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import figures  # bench/figures.py, beside this script
import torch
from lib import flags
from tqdm import tqdm

from pdserve.protocol.codec import from_dict
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord, KVHandle
from pdserve.transfer.pool_server import DTYPES, fill_pool

ROOT = Path(__file__).resolve().parent.parent

SEED = 7


def parse_args() -> argparse.Namespace:
    p = flags.parser(__doc__, "tiny shape, a few seconds")
    flags.add_ints(p, tokens=4096, layers=32, kv_heads=8, head_dim=128, block_size=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    flags.add_ints(p, iters=5, threads=min(4, os.cpu_count() or 1))
    p.add_argument(
        "--device",
        default="cpu",
        help="both pools' device: cuda moves VRAM to VRAM (NIXL registers the pools "
        "as VRAM; the tcp transport stages through pinned host memory)",
    )
    p.add_argument("--plot", default=str(ROOT / "bench" / "out" / "kv_transfer.png"))
    args = p.parse_args()
    if args.quick:
        args.tokens, args.layers, args.kv_heads, args.head_dim, args.iters = 256, 4, 2, 64, 3
    return args


def block_maps(n: int, pool_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """Runs of up to 16 consecutive ids in shuffled order, different on the two sides."""
    rng = random.Random(seed)

    def one() -> list[int]:
        runs = [list(range(s, min(s + 16, pool_blocks))) for s in range(0, pool_blocks, 16)]
        rng.shuffle(runs)
        return [b for run in runs for b in run][:n]

    return one(), one()


class Peer:
    def __init__(self, args: argparse.Namespace, transport: str, blocks: int) -> None:
        cmd = [
            sys.executable,
            "-m",
            "pdserve.transfer.pool_server",
            "--transport",
            transport,
            "--layers",
            str(args.layers),
            "--blocks",
            str(blocks),
            "--block-size",
            str(args.block_size),
            "--kv-heads",
            str(args.kv_heads),
            "--head-dim",
            str(args.head_dim),
            "--dtype",
            args.dtype,
            "--seed",
            str(SEED),
            "--model",
            "bench",
            "--threads",
            str(args.threads),
            "--device",
            args.device,
        ]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        assert self.proc.stdout is not None
        self.info = self._line("{")
        if self.info is None:
            raise RuntimeError(f"pool_server exited early (rc={self.proc.wait()})")

    def _line(self, prefix: str) -> dict | None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # skip NIXL's log lines
            if line.startswith(prefix):
                return json.loads(line)
        return None

    def handle(self, rid: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """A lease the peer starts on ``block_ids`` (claimed and ended by each load)."""
        assert self.proc.stdin is not None
        cmd = {"hold": rid, "block_ids": block_ids, "num_tokens": num_tokens}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._line('{"handle"')
        assert reply is not None, "pool_server exited"
        return from_dict(reply["handle"], KVHandle)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def run_transport(args, transport, dst, expected, remote, local, num_bytes) -> float:
    peer = Peer(args, transport, expected.shape[2])
    conn = RemoteKVConnector(
        dst, CompatRecord.for_pool(dst, "bench"), transport, transfer_timeout=120
    )
    times = []
    try:
        for i in tqdm(range(args.iters + 1), desc=f"{transport:>6}", file=sys.stderr):
            dst.zero_()
            rid = f"{transport}-{i}"
            handle = peer.handle(rid, remote, len(remote) * args.block_size)
            t0 = time.perf_counter()
            conn.start_load(rid, handle, remote, local)
            res = []
            while not res:  # an engine loop: poll once per (short) step
                time.sleep(0.0005)
                res = conn.poll()
            elapsed = time.perf_counter() - t0
            assert res[0].ok and res[0].num_bytes == num_bytes, res
            if i > 0:  # the first one pays the handshake and connection set-up
                times.append(elapsed)
        check(dst, expected, remote, local, transport)
    finally:
        conn.close()
        peer.close()
    return num_bytes / statistics.median(times) / 1e9


def check(dst, expected, remote, local, what) -> None:
    got = dst[:, :, local].cpu().contiguous().view(torch.uint8)
    want = expected[:, :, remote].contiguous().view(torch.uint8)
    if not torch.equal(got, want):
        raise SystemExit(f"{what}: transferred bytes differ from the source")


def run_memcpy(args, expected, remote, num_bytes) -> float:
    # The fastest plain torch gather found: index_select over the block dim of a
    # [layers * 2, blocks, block elements] view (dim 2 of the 6-d pool is ~10x slower).
    dev = torch.device(args.device)
    idx = torch.tensor(remote, dtype=torch.long, device=dev)
    planes = expected.to(dev).view(expected.shape[0] * 2, expected.shape[2], -1)
    out = torch.empty(
        (planes.shape[0], len(remote), planes.shape[2]), dtype=expected.dtype, device=dev
    )
    times = []
    for i in tqdm(range(args.iters + 1), desc="memcpy", file=sys.stderr):
        out.zero_()
        _sync(dev)
        t0 = time.perf_counter()
        torch.index_select(planes, 1, idx, out=out)
        _sync(dev)
        if i > 0:
            times.append(time.perf_counter() - t0)
    want = expected[:, :, remote].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(out.cpu().view(torch.uint8).reshape(-1), want)
    return num_bytes / statistics.median(times) / 1e9


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def plot(path: str, result: dict[str, float], title: str) -> None:
    plt = figures.pyplot()

    names = ["NIXL (2 processes)", "tcp transport (2 processes)", "torch copy (1 process)"]
    values = [result["nixl_gbps"], result["tcp_gbps"], result["memcpy_gbps"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["#2a9d8f", "#e76f51", "#8d99ae"])
    ax.bar_label(bars, [f"{v:.2f} GB/s" for v in values])
    ax.set_ylabel("GB/s")
    ratios = f"NIXL = {result['nixl_vs_memcpy']:.2f}x torch copy, {result['nixl_vs_tcp']:.1f}x tcp"
    ax.set_title(f"{title}\n{ratios}", fontsize=10)
    figures.save(fig, path, dpi=120)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    n = -(-args.tokens // args.block_size)
    pool_blocks = n + 64  # the pools are larger than the request, as in a worker
    shape = (args.layers, 2, pool_blocks, args.block_size, args.kv_heads, args.head_dim)
    dtype = DTYPES[args.dtype]
    expected = fill_pool(torch.empty(shape, dtype=dtype), SEED)  # what the peer holds
    dst = torch.zeros(shape, dtype=dtype, device=args.device)
    remote, local = block_maps(n, pool_blocks, SEED)
    num_bytes = n * expected[0, 0, 0].numel() * expected.element_size() * 2 * args.layers
    print(
        f"KV of {args.tokens} tokens: {n} blocks, {num_bytes / 2**20:.0f} MiB, "
        f"shape {list(shape)} {args.dtype}",
        file=sys.stderr,
    )
    result = {
        "memcpy_gbps": run_memcpy(args, expected, remote, num_bytes),
        "nixl_gbps": run_transport(args, "nixl", dst, expected, remote, local, num_bytes),
        "tcp_gbps": run_transport(args, "tcp", dst, expected, remote, local, num_bytes),
    }
    result["nixl_vs_memcpy"] = result["nixl_gbps"] / result["memcpy_gbps"]
    result["nixl_vs_tcp"] = result["nixl_gbps"] / result["tcp_gbps"]
    result = {k: round(v, 3) for k, v in result.items()}
    for k, v in result.items():
        print(f"{k:>15}: {v}", file=sys.stderr)
    title = f"KV of a {args.tokens}-token prompt ({num_bytes / 2**20:.0f} MiB, {args.dtype})"
    plot(args.plot, result, title)
    print(
        json.dumps(
            {
                **result,
                "bytes": num_bytes,
                "tokens": args.tokens,
                "quick": args.quick,
                "device": args.device,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
