"""Helpers for the KV transfer tests: small pools, a pair of endpoints, a peer process."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.engine.kv_connector import LoadResult
from pdserve.protocol.codec import from_dict
from pdserve.transfer.connector import RemoteKVConnector
from pdserve.transfer.messages import CompatRecord, KVHandle
from pdserve.transfer.pool_server import fill_pool
from pdserve.transfer.server import KVServer

torch.set_num_threads(1)

TRANSPORTS = ["nixl", "tcp"]
SHAPE = {"layers": 2, "block_size": 4, "kv_heads": 2, "head_dim": 8}


def make_pool(num_blocks: int, seed: int | None, dtype: torch.dtype = torch.float32, **shape_kw):
    s = {**SHAPE, **shape_kw}
    shape = (s["layers"], 2, num_blocks, s["block_size"], s["kv_heads"], s["head_dim"])
    pool = torch.zeros(shape, dtype=dtype)
    return fill_pool(pool, seed) if seed is not None else pool


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def wait_results(conn: RemoteKVConnector, n: int, timeout: float) -> list[LoadResult]:
    out: list[LoadResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out += conn.poll()
        time.sleep(0.002)
    assert len(out) == n, f"got {len(out)} of {n} results within {timeout}s: {out}"
    return out


def load_with(
    transport: str, server_secret: str | tuple[str, ...], decode_secret: str | tuple[str, ...]
) -> tuple[LoadResult, bool]:
    """Two blocks from a KVServer holding ``server_secret`` into a connector holding
    ``decode_secret`` (a secret or a rotation's tuple of secrets): the load's result, and
    whether any byte reached the decode pool."""
    src, dst = make_pool(8, seed=2), make_pool(8, seed=None)
    server = KVServer(src, CompatRecord.for_pool(src, "m"), transport, secret=server_secret)
    conn = RemoteKVConnector(
        dst, CompatRecord.for_pool(dst, "m"), transport, transfer_timeout=3, secret=decode_secret
    )
    try:
        conn.start_load("a", server.make_handle("a", [1, 2], 8, []), [1, 2], [0, 1])
        (res,) = wait_results(conn, 1, timeout=6)
        return res, bool(as_bytes(dst).any())
    finally:
        conn.close()
        server.close()


@dataclass
class Pair:
    server: KVServer
    conn: RemoteKVConnector
    src: torch.Tensor
    dst: torch.Tensor

    def handle(
        self, rid: str, block_ids: list[int], num_tokens: int | None = None, lease: float = 30.0
    ) -> KVHandle:
        bs = self.server.compat.block_size
        n = num_tokens if num_tokens is not None else len(block_ids) * bs
        return self.server.make_handle(rid, block_ids, n, [], lease)


class ForkedPeer:
    """``python -m pdserve.transfer.pool_server ARGS`` as far as the tests use a Popen of it
    (pid, stdin, stdout, poll, wait, kill, returncode), forked from a fork server that has
    imported torch and the server once (``multiprocessing``'s forkserver: a clean process,
    no UCX or threads of this one). A process of its own per peer, as before, without
    its ~2 CPU-s of imports each (11 peers in test_kv_cross_process.py). stdin and stdout
    are one socket: closing ``stdin`` shuts down its writing half, the peer reads EOF."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["pdserve.transfer.pool_server"])
        ours, theirs = socket.socketpair()
        self._proc = ctx.Process(target=_serve_peer, args=(args, env, theirs), daemon=True)
        self._proc.start()
        theirs.close()
        self.pid = self._proc.pid
        self.stdout = ours.makefile("r", encoding="utf-8")
        self.stdin = _WriteHalf(ours)

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("pool_server", timeout or 0)
        return self._proc.exitcode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


class _WriteHalf:
    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._file = sock, sock.makefile("w", encoding="utf-8")

    def write(self, text: str) -> int:
        return self._file.write(text)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self._sock.shutdown(socket.SHUT_WR)


def _serve_peer(args: list[str], env: dict[str, str], sock: socket.socket) -> None:
    """The forked peer: the socket as its stdin and stdout (NIXL's own lines too), the
    caller's environment (UCX reads it when the agent is made), then the server's main."""
    import argparse

    from pdserve.transfer import pool_server

    os.dup2(sock.fileno(), 0)
    os.dup2(sock.fileno(), 1)
    sock.close()
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    parser = argparse.ArgumentParser()
    pool_server.add_arguments(parser)
    sys.exit(pool_server.run(parser.parse_args(args)))


class PeerProcess:
    """A real prefill-side process (``pdserve.transfer.pool_server``) on 127.0.0.1."""

    def __init__(
        self,
        transport: str,
        blocks: int,
        seed: int,
        env: dict[str, str] | None = None,
        **extra: object,
    ) -> None:
        args = ["--transport", transport, "--blocks", str(blocks), "--seed", str(seed)]
        for k, v in {**SHAPE, **extra}.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.proc = ForkedPeer(args, {**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        info = None
        for line in self.proc.stdout:  # NIXL logs to stdout too: skip its lines
            if line.startswith("{"):
                info = json.loads(line)
                break
        assert info is not None, f"peer process exited early (rc={self.proc.wait()})"
        self.agent_name: str = info["agent_name"]
        self.side_channel: str = info["side_channel"]
        self._lines: queue.Queue[str] = queue.Queue()
        self._handles: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith('{"handle"'):
                self._handles.put(line)
            elif line.startswith("{"):
                self._lines.put(line)

    def handle(self, rid: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        """A lease on ``block_ids`` started by the peer process, and its handle."""
        assert self.proc.stdin is not None
        cmd = {"hold": rid, "block_ids": block_ids, "num_tokens": num_tokens}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return from_dict(json.loads(self._handles.get(timeout=10))["handle"], KVHandle)

    def released(self, timeout: float) -> str:
        try:
            return str(json.loads(self._lines.get(timeout=timeout))["released"])
        except queue.Empty:
            raise AssertionError("no lease release reported by the peer process") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
