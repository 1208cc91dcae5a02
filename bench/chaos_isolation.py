"""Issue 44's probes for bench/chaos.py: each count is what an attack got through, 0 the goal.

- ``admin_port_unauthenticated_changes``: LoRA load/unload sent without a key to the
  live service's router ``--admin-port`` (and to its API port) that were not refused;
- ``picker_mode_limit_bypass``: the abuse battery of tests/router/test_abuse_both_modes.py
  (no key, a wrong key, rpm, tpm, body size, per-key concurrency) against an endpoint
  picker over fake workers: attacks that got a different answer than the router mode's;
- ``merged_pod_policy_escapes``: podTemplates that unset the rendered hardening through
  the merge (``drop: []``, nulls, an unhardened sidecar) that the pod policy let render;
- ``cache_symlink_followed``: symlinks planted in a sealed compile cache (a linked
  directory, linked files) left there for the loader after verify and seal;
- ``abandoned_compiles_over_bound``: grammar compile threads past the bound while four
  keys each send grammars that never compile in time (a real engine core loop);
- ``lora_path_escapes``: run-time LoRA loads outside ``--lora-root`` a real registry took,
  plus errors that told an existing path from a missing one.
- ``worker_call_replayed_elsewhere``: a signed call captured on its way to one worker
  (a real uvicorn worker with the workers' check), sent on to another worker of the
  service, with its own Host and with the first worker's, that was served;
- ``prefill_pin_misused``: the picker's signed ``x-prefiller-host-port`` value taken by a
  front when expired, for another request's body, or signed under another key's purpose.
- ``picker_ext_proc_unauthenticated``: streams to a picker serving mutual TLS from a
  plaintext client, a TLS client without a certificate and one with another CA's
  certificate (each sending forged ``served`` metadata) that reached ext_proc, plus
  decode workers their forgery took out;
- ``proc_budget_over_cap``: requests admitted beyond a per-key cap of 1 by four
  ``--procs`` processes sharing the replica's table, one key's 16 requests spread over them;
- ``replica_budget_over_cap``: requests admitted beyond a per-key cap of 1 by three router
  replicas' budget owners over real signed HTTP (router/peer_budgets.py), one key's 12
  requests spread over them, then a key whose owner stopped answering asked 6 times of
  the other two (each admitted one is over: they must refuse, 503);
- ``budget_membership_over_cap``: requests admitted beyond a per-key cap of 1 while a
  replica joins three replicas' budget owners and the key moves to it, the joiner seeing
  the new peer list ``ADOPT_WAIT_S`` before the others (a slow watch): asked through
  every replica before, during and after the change, with one request of the key in
  flight at its old owner until everyone agrees;
- ``model_file_swap_loaded``: model files in a sealed shared cache swapped after the
  service's first load (tokenizer, weights, an added chat template, a symlink) that the
  next load took, and a tokenizer swapped right after a load's check that the load then
  handed to transformers;
- ``compiled_cache_swap_loaded``: compiled-code entries of a sealed shared cache swapped
  after their check (while the worker's private copy is made, and after it) that reached
  the copy inductor reads, and files a worker's publish wrote through a planted link
  (tests/engine/test_sealed_copy.py runs the same swap through a real inductor load).

The in-process probes are the ones the suite holds to 0 (pdserve/testing/engine_probes.py,
pod_policy_probe.py): the bench runs what the suite checks, against the code as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx


async def admin_port_changes(url: str, admin_url: str, adapter: str) -> int:
    """Keyless LoRA changes the live router did not refuse (401/403), on both ports."""
    accepted = 0
    async with httpx.AsyncClient(timeout=60) as h:
        for base in (admin_url, url):
            load = {"lora_name": "chaos-evil", "lora_path": adapter}
            unload = {"lora_name": "chaos-evil"}
            for path, body in (
                ("/v1/load_lora_adapter", load),
                ("/v1/unload_lora_adapter", unload),
            ):
                r = await h.post(base + path, json=body)
                accepted += r.status_code not in (401, 403)
    return accepted


def picker_bypass(model_dir: Path) -> int:
    from pdserve.router.tokenizer import PromptTokenizer
    from pdserve.testing.abuse import picker_mode_bypasses
    from pdserve.testing.picker import start_picker

    tokenizer = PromptTokenizer(str(model_dir))
    return asyncio.run(picker_mode_bypasses(lambda **kw: start_picker(tokenizer, model_dir, **kw)))


def merged_policy_escapes() -> int:
    from pdserve.testing.pod_policy_probe import merged_escapes

    return int(merged_escapes())


def symlinks_followed() -> int:
    from pdserve.testing.engine_probes import symlink_probe

    with tempfile.TemporaryDirectory() as tmp:
        return int(symlink_probe(Path(tmp)))


def abandoned_over_bound(model_dir: Path) -> int:
    import zmq

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.testing.engine_probes import abandoned_probe
    from pdserve.testing.tiny_engine import tiny_config
    from pdserve.worker.core.loop import CoreLoop

    engine = LLMEngine(tiny_config(model_dir))
    ctx = zmq.Context()
    commands, results, reader = (ctx.socket(zmq.PAIR) for _ in range(3))
    commands.bind("inproc://chaos-c")
    results.bind("inproc://chaos-r")
    reader.connect("inproc://chaos-r")
    release, real = threading.Event(), engine.grammars.compile

    def held(spec: dict[str, Any]) -> Any:  # a grammar that never compiles in time
        release.wait(30)
        return real(spec)

    engine.grammars.compile = held  # type: ignore[method-assign]
    try:
        return abandoned_probe(CoreLoop(engine, commands, results), reader, engine)
    finally:
        release.set()
        with contextlib.suppress(Exception):
            while reader.poll(10):
                pickle.loads(reader.recv())
        for s in (commands, results, reader):
            s.close(0)
        ctx.term()


def lora_escapes(model_dir: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.testing.engine_probes import lora_path_probe
    from pdserve.testing.lora_adapters import SPECS, write_adapter

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    with tempfile.TemporaryDirectory() as tmp:
        outside = write_adapter(model_dir, Path(tmp) / "outside", SPECS[0])
        escapes, revealing = lora_path_probe(outside, hf, Path(tmp))
    return escapes + revealing


async def _replayed_elsewhere() -> int:
    from fastapi import FastAPI

    from pdserve import keys, signing
    from pdserve.testing.router_fakes import serve
    from pdserve.worker.http import SecretCheck

    secret = os.environ["PDSERVE_SERVICE_SECRET"]
    app = FastAPI()
    app.add_middleware(SecretCheck, secret=(secret,))
    app.post("/prefill")(lambda: {"ok": True})
    ring = keys.KeyRing(keys.HTTP, secret)
    served = 0
    async with serve(app) as a_url, serve(app) as b_url, httpx.AsyncClient(timeout=10) as c:
        a_host = a_url.split("://")[1]
        for host in (None, a_host):
            auth = signing.sign(ring, "POST", "/prefill", b"ids", host=a_host)
            headers = {signing.HEADER: auth, **({"Host": host} if host else {})}
            resp = await c.post(b_url + "/prefill", content=b"ids", headers=headers)
            served += resp.status_code == 200
    return served


def replayed_elsewhere() -> int:
    return asyncio.run(_replayed_elsewhere())


def prefill_pin_misused() -> int:
    import time

    from pdserve import keys
    from pdserve.router.picker import prefill_header as ph

    endpoint, body = "10.0.0.7:8100", b'{"prompt": "a"}'
    tag = keys.KeyRing.from_env(keys.HTTP).sign(b"pdserve/prefill-endpoint", endpoint.encode())
    misuses = [
        (ph.sign(endpoint, body, now=time.time() - 3 * ph.WINDOW_S), body),  # expired
        (ph.sign(endpoint, body), b'{"prompt": "another"}'),  # another request
        (f"{time.time():.3f} {tag.hex()}", body),  # the HTTP key's tag
    ]
    return sum(ph.verified(endpoint, sig, sent) for sig, sent in misuses)


async def _ext_proc_unauthenticated(model_dir: Path) -> int:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from pdserve.router.picker.service import ExtProcTLS
    from pdserve.router.tokenizer import PromptTokenizer
    from pdserve.testing.picker import Envoy, completion, forged_served_messages, start_picker
    from pdserve.testing.tls_certs import ScratchCA

    with tempfile.TemporaryDirectory() as tmp:
        ca, other = ScratchCA.make(Path(tmp), "ca"), ScratchCA.make(Path(tmp), "other")
        key, cert = ca.issue("picker", server=True).pem()
        tls = ExtProcTLS(cert, key, ca.cert.read_bytes())
        root = ca.cert.read_bytes()
        gw_key, gw_cert = ca.issue("gateway").pem()
        st_key, st_cert = other.issue("gateway").pem()
        tokenizer = PromptTokenizer(str(model_dir))
        reached = 0
        gateway = grpc.ssl_channel_credentials(root, gw_key, gw_cert)
        async with start_picker(
            tokenizer, model_dir, busy=[1], health_interval_s=30.0, tls=tls, client_tls=gateway
        ) as pc:
            address = f"127.0.0.1:{pc.service.port}"
            rogues = [
                grpc.aio.insecure_channel(address),
                grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root)),
                grpc.aio.secure_channel(
                    address, grpc.ssl_channel_credentials(root, st_key, st_cert)
                ),
            ]
            for channel in rogues:
                env = Envoy(ep_grpc.ExternalProcessorStub(channel))
                for msg in forged_served_messages(completion("hi"), pc.endpoint(1)):
                    env.queue.put_nowait(msg)
                env.close()
                reached += await env.call.code() != grpc.StatusCode.UNAVAILABLE
                await channel.close()
            taken_out = sum(pc.service.rt.discovery.failed_check(u) for u in pc.decode_urls)
            pc.decode[1].active.pop("busy", None)
        return reached + taken_out


def ext_proc_unauthenticated(model_dir: Path) -> int:
    return asyncio.run(_ext_proc_unauthenticated(model_dir))


def proc_budget_over_cap() -> int:
    from pdserve.router.admission import Admission
    from pdserve.router.errors import APIError
    from pdserve.router.shared_limits import SharedLimits

    async def probe() -> int:
        table = SharedLimits(slots=64)
        procs = [Admission(8, per_client=1, max_waiting=8, shared=table) for _ in range(4)]
        tickets = []
        for i in range(16):
            with contextlib.suppress(APIError):
                tickets.append(await procs[i % 4].acquire("key:a"))
        for t in tickets:
            t.release()
        return len(tickets) - 1

    return asyncio.run(probe())


def replica_budget_over_cap() -> int:
    from pdserve.router.errors import APIError
    from pdserve.router.peer_budgets import budget_id, owner_of
    from pdserve.testing.peer_replicas import replicas

    async def probe() -> int:
        async with replicas(3, cap=1) as reps:
            admitted = 0
            for i in range(12):
                with contextlib.suppress(APIError):
                    await reps[i % 3].budgets.enter("key:a")
                    admitted += 1
            over = max(admitted - 1, 0)
            urls = sorted(r.url for r in reps)
            owner = next(r for r in reps if r.url == owner_of(budget_id("key:b"), urls))
            await owner.stop()
            others = [r for r in reps if r is not owner]
            for i in range(6):
                with contextlib.suppress(APIError):
                    await others[i % 2].budgets.enter("key:b")
                    over += 1
            return over

    return asyncio.run(probe())


def budget_membership_over_cap() -> int:
    from pdserve.router import peer_budgets as pb
    from pdserve.router.errors import APIError
    from pdserve.testing.peer_replicas import replicas

    async def admitted(reps: list, key: str) -> int:  # type: ignore[type-arg]
        n = 0
        for r in reps:
            with contextlib.suppress(APIError):
                await r.budgets.acquire(key)
                n += 1
        return n

    async def probe() -> int:
        async with replicas(3, cap=1) as reps:
            urls = sorted(r.url for r in reps)
            joiner = reps[2]
            rest = sorted(u for u in urls if u != joiner.url)
            key = next(
                k
                for i in range(5000)
                if pb.owner_of(pb.budget_id(k := f"key:{i}"), urls) == joiner.url
            )
            holder = next(r for r in reps if r.url != pb.owner_of(pb.budget_id(key), rest))
            for r in reps:
                r.budgets.set_peers(rest)
            for r in reps:
                await r.budgets.settled(3.0)
            for _ in range(60):  # in flight at the old owner: the cap is used
                with contextlib.suppress(APIError):
                    await holder.budgets.acquire(key)
                    break
                await asyncio.sleep(0.1)
            over = await admitted(reps, key)
            joiner.budgets.set_peers(urls)  # the joiner sees the change first
            await asyncio.sleep(pb.ADOPT_WAIT_S + 0.2)
            over += await admitted(reps, key)
            for r in reps:
                r.budgets.set_peers(urls)
            for r in reps:
                await r.budgets.settled(3.0)
            over += await admitted(reps, key)
            holder.budgets.leave(key)
            await asyncio.sleep(0.3)  # its give-back reaches the new owner
            return over + max(await admitted(reps, key) - 1, 0)

    return asyncio.run(probe())


def model_file_swap_loaded() -> int:
    from pdserve import keys
    from pdserve.engine import model_seal

    ring = keys.KeyRing(keys.COMPILE_CACHE, ("chaos",))
    swaps = [
        lambda d: (d / "tokenizer.json").write_text('{"theirs": 1}'),
        lambda d: (d / "model.safetensors").write_bytes(b"theirs"),
        lambda d: (d / "chat_template.jinja").write_text("{{ theirs }}"),
        lambda d: ((d / "config.json").unlink(), (d / "config.json").symlink_to(d.parent / "x")),
    ]
    loaded = 0
    for swap in swaps:
        with tempfile.TemporaryDirectory() as tmp:
            model, seals = Path(tmp) / "m", Path(tmp) / "seals"
            model.mkdir()
            (Path(tmp) / "x").write_text("{}")
            for name in ("config.json", "tokenizer.json", "model.safetensors"):
                (model / name).write_bytes(os.urandom(64))
            model_seal._loaded.pop(str(model.resolve()), None)
            model_seal.check(str(model), ring, seals)
            swap(model)
            model_seal._loaded.pop(str(model.resolve()), None)
            try:
                model_seal.check(str(model), ring, seals)
                loaded += 1
            except model_seal.ModelSealError:
                pass
    # ...and a swap right after the check: what transformers reads is the private
    # copy of the checked bytes, never the swapped file
    with tempfile.TemporaryDirectory() as tmp:
        model, seals = Path(tmp) / "m", Path(tmp) / "seals"
        model.mkdir()
        for name in ("config.json", "tokenizer.json", "model.safetensors"):
            (model / name).write_bytes(os.urandom(64))
        model_seal._loaded.pop(str(model.resolve()), None)
        model_seal.check(str(model), ring, seals)
        model_seal._loaded.pop(str(model.resolve()), None)
        sealed = model_seal.load(str(model), ring, seals, model_seal.SKIP)
        theirs = b'{"theirs": 1}'
        (model / "tokenizer.json").write_bytes(theirs)
        if sealed is None or (sealed.files / "tokenizer.json").read_bytes() == theirs:
            loaded += 1
    return loaded


def compiled_cache_swap_loaded() -> int:
    """Compiled-code entries of a sealed shared cache swapped after their check (while the
    worker's private copy is made, and after it) that reached the copy inductor reads, and
    files a worker's publish wrote through a planted link (engine/sealed_copy.py)."""
    from pdserve import keys
    from pdserve.engine import cache_seal, sealed_copy

    ring = keys.KeyRing(keys.COMPILE_CACHE, ("chaos",))
    loaded = 0
    with tempfile.TemporaryDirectory() as tmp:
        shared, private = Path(tmp) / "shared", Path(tmp) / "private"
        (shared / "fxgraph" / "ab").mkdir(parents=True)
        (shared / "fxgraph" / "ab" / "entry").write_bytes(b"ours")
        (shared / "cd").mkdir()
        (shared / "cd" / "graph.py").write_text("x = 1")
        cache_seal.seal(shared, ring)

        def swap(folder: Path, rel: str) -> None:
            (folder / rel).write_bytes(b"theirs")

        sealed_copy.after_check = swap
        try:
            sealed_copy.copy_checked(shared, private, ring)
        finally:
            sealed_copy.after_check = None
        for rel in ("fxgraph/ab/entry", "cd/graph.py"):
            loaded += (private / rel).read_bytes() == b"theirs"
            (shared / rel).write_bytes(b"theirs again")  # after the copy
            loaded += (private / rel).read_bytes() != (b"ours" if "entry" in rel else b"x = 1")
        outside = Path(tmp) / "outside"
        outside.mkdir()
        (shared / "ef").symlink_to(outside, target_is_directory=True)
        (private / "ef").mkdir()
        (private / "ef" / "new.so").write_bytes(b"built")
        sealed_copy.publish(private, shared, ring, {})
        loaded += len(list(outside.iterdir()))
    return loaded


def in_process_probes(model_dir: Path) -> dict[str, int]:
    # the tests' fake workers sign with the service secret, as the suite's conftest sets it
    os.environ.setdefault("PDSERVE_SERVICE_SECRET", secrets.token_hex(16))
    return {
        "picker_mode_limit_bypass": picker_bypass(model_dir),
        "merged_pod_policy_escapes": merged_policy_escapes(),
        "cache_symlink_followed": symlinks_followed(),
        "abandoned_compiles_over_bound": abandoned_over_bound(model_dir),
        "lora_path_escapes": lora_escapes(model_dir),
        "worker_call_replayed_elsewhere": replayed_elsewhere(),
        "prefill_pin_misused": prefill_pin_misused(),
        "picker_ext_proc_unauthenticated": ext_proc_unauthenticated(model_dir),
        "proc_budget_over_cap": proc_budget_over_cap(),
        "model_file_swap_loaded": model_file_swap_loaded(),
        "compiled_cache_swap_loaded": compiled_cache_swap_loaded(),
        "replica_budget_over_cap": replica_budget_over_cap(),
        "budget_membership_over_cap": budget_membership_over_cap(),
    }
