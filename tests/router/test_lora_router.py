"""The router's LoRA side against fake workers: an adapter named as the request's ``model``
reaches both workers as a LoraRef with its files' hash, /v1/models lists the adapters under
their base, the admin endpoints fan out to every worker, and the prefix index hashes an
adapter's prompts as the workers do (hashing.salt_root's ``extra_key``)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.engine.lora_files import adapter_hash
from pdserve.protocol.contract import GenerateRequest, LoraRef, PrefillRequest
from pdserve.protocol.hashing import block_hashes, salt_root
from pdserve.router.adapters import declared, parse_lora
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import StaticSource
from pdserve.testing.loopback import free_port
from pdserve.testing.router_fakes import serve
from tests.router.lora_fakes import lora_cluster, write_adapter

pytestmark = pytest.mark.unit

LONG = "the quick brown fox jumps over the lazy dog " * 12  # > the disagg threshold
TENANT, ADMIN = ({"Authorization": f"Bearer {k}"} for k in ("tenant", "boss"))
KEYS = {"api_keys": ("tenant",), "admin_api_keys": ("boss",)}


def _body(model: str, prompt: str = LONG) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}


async def _until(check: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.05)


def test_lora_flag_and_declared_adapters(tmp_path: Path) -> None:
    good = write_adapter(tmp_path, "sql")
    assert parse_lora(f"sql={good}") == ("sql", str(good))
    for bad in ("sql", "=x", "sql=", "a\x00b=x"):
        with pytest.raises(ValueError, match="--lora"):
            parse_lora(bad)
    (a,) = declared([("sql", str(good))], ("tiny",))
    assert a.hash == adapter_hash(good) and a.path == str(good)
    with pytest.raises(ValueError, match="cannot read the adapter"):
        declared([("gone", str(tmp_path / "missing"))], ("tiny",))
    with pytest.raises(ValueError, match="twice"):
        declared([("sql", str(good)), ("sql", str(good))], ("tiny",))
    with pytest.raises(ValueError, match="base model"):
        declared([("tiny", str(good))], ("tiny",))


async def test_adapter_request_carries_lora_to_both_workers(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    sql, chat = write_adapter(tmp_path, "sql", 1), write_adapter(tmp_path, "chat", 2)
    loras = (("sql", str(sql)), ("chat", str(chat)))
    kw: dict[str, Any] = {"loras": loras, "disagg_threshold": 8}
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir, **kw) as (c, fakes),
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        fakes[1].resident.append("sql")  # the decode worker holds sql in memory
        await _until(lambda: c.runtime.discovery.snapshot().decode[0].stats.loras == ["sql"])
        models = (await h.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "sql", "chat"]
        assert all(m["parent"] == "tiny" for m in models[1:]) and "parent" not in models[0]
        assert str(tmp_path) not in str(models)  # paths are the operator's
        for model, want in (("sql", LoraRef("sql", adapter_hash(sql))), ("tiny", None)):
            r = await h.post("/v1/completions", json=_body(model))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            pre, gen = c.prefill[0].requests[-1], c.decode[0].requests[-1]
            assert isinstance(pre, PrefillRequest) and isinstance(gen, GenerateRequest)
            assert pre.lora == want and gen.lora == want
        short = await h.post("/v1/completions", json=_body("chat", "hi"))  # decode only
        assert short.status_code == 200
        assert c.decode[0].requests[-1].lora == LoraRef("chat", adapter_hash(chat))
        chat_r = await h.post(
            "/v1/chat/completions",
            json={
                "model": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "n": 2,
            },
        )
        assert chat_r.status_code == 200, chat_r.text
        assert all(r.lora is not None for r in c.decode[0].requests[-2:])
        routed = {
            (s.labels["role"], s.labels["resident"]): s.value
            for s in c.runtime.metrics.lora_routed.collect()[0].samples
            if s.name.endswith("_total")
        }
        assert routed[("decode", "true")] == 1 and routed[("prefill", "false")] >= 1
        assert routed[("decode", "false")] >= 2 and ("prefill", "true") not in routed
        missing = await h.post("/v1/completions", json=_body("nope"))
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        await c.settle()


async def test_prefix_index_matches_the_workers_keyed_hashes(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    """The prefill fakes publish blocks hashed under the adapter (as the engine does); the
    router's second request of the prompt finds them, and the base model's does not."""
    sql = write_adapter(tmp_path, "sql", 1)
    async with (
        lora_cluster(
            router_tokenizer, tiny_model_dir, loras=(("sql", str(sql)),), disagg_threshold=8
        ) as (c, _),
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        assert (await h.post("/v1/completions", json=_body("sql"))).status_code == 200
        ids = c.prefill[0].requests[-1].prompt_token_ids
        rt = c.runtime
        keyed = block_hashes(ids, 16, salt_root(None, adapter_hash(sql)))
        await _until(lambda: rt.index.match(keyed).get("p0", 0) == len(keyed))
        assert rt.index.match(block_hashes(ids, 16)) == {}  # base-model hashes: no match
        snap = rt.discovery.snapshot()
        plan = rt.scheduler.plan(ids, snap, None, rt.loras.ref("sql"))
        assert plan.matched_tokens == len(keyed) * 16
        assert rt.scheduler.plan(ids, snap, None, None).matched_tokens == 0
        await c.settle()


async def test_admin_load_and_unload_fan_out(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    sql = write_adapter(tmp_path, "sql", 3)
    kw: dict[str, Any] = {**KEYS, "disagg_threshold": 8}
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir, n_decode=2, **kw) as (c, fakes),
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        load = {"lora_name": "sql", "lora_path": str(sql)}
        r = await h.post("/v1/load_lora_adapter", json=load, headers=TENANT)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert (await h.post("/v1/load_lora_adapter", json=load)).status_code == 401
        assert all(not f.calls for f in fakes)
        r = await h.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json() == {"name": "sql", "hash": adapter_hash(sql)}
        assert all(f.known == {"sql": adapter_hash(sql)} for f in fakes)  # prefill and decode
        ids = [m["id"] for m in (await h.get("/v1/models", headers=TENANT)).json()["data"]]
        assert ids == ["tiny", "sql"]
        again = await h.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
        assert again.status_code == 400 and again.json()["error"]["code"] == "lora_exists"
        r = await h.post("/v1/completions", json=_body("sql"), headers=TENANT)
        assert r.status_code == 200 and c.decode[0].requests + c.decode[1].requests
        gen = [q for d in c.decode for q in d.requests][-1]
        assert gen.lora == LoraRef("sql", adapter_hash(sql))
        r = await h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN)
        assert r.status_code == 200 and all(not f.known for f in fakes)
        gone = await h.post("/v1/completions", json=_body("sql"), headers=TENANT)
        assert gone.status_code == 404
        r = await h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
        await c.settle()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"lora_name": "", "lora_path": "/x"}, "lora_name"),
        ({"lora_name": 3, "lora_path": "/x"}, "lora_name"),
        ({"lora_name": "a"}, "lora_path"),
        ({"lora_name": "a", "lora_path": ""}, "lora_path"),
        ({"lora_name": "a", "lora_path": "/x", "load_inplace": True}, "load_inplace"),
        ({"lora_name": "tiny", "lora_path": "/x"}, "lora_name"),  # the base model's name
    ],
)
async def test_admin_load_refuses_bad_bodies_by_field(
    router_tokenizer, tiny_model_dir, body: dict[str, Any], field: str
) -> None:
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir, admin_api_keys=("boss",)) as (c, fakes),
        httpx.AsyncClient(base_url=c.url, headers=ADMIN) as h,
    ):
        r = await h.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert all(not f.calls for f in fakes)


async def test_admin_load_undone_when_a_worker_refuses(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    """One worker refuses (400 naming lora_path): the caller hears it and the workers that
    had loaded the adapter unload it; the router does not list it. Different files at one
    path (two hashes) are refused the same way."""
    sql = write_adapter(tmp_path, "sql", 4)
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir, admin_api_keys=("boss",)) as (c, fakes),
        httpx.AsyncClient(base_url=c.url, headers=ADMIN) as h,
    ):
        fakes[1].refuse = "400"
        load = {"lora_name": "sql", "lora_path": str(sql)}
        r = await h.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert fakes[0].calls == [("load", "sql"), ("unload", "sql")] and not fakes[0].known
        missing = {"lora_name": "x", "lora_path": str(tmp_path / "none")}
        fakes[1].refuse = ""
        r = await h.post("/v1/load_lora_adapter", json=missing)
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        fakes[1].hash_override = "f" * 32  # the second worker reads other files there
        r = await h.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 400 and "different files" in r.json()["error"]["message"]
        assert all(not f.known for f in fakes)
        ids = [m["id"] for m in (await h.get("/v1/models")).json()["data"]]
        assert ids == ["tiny"]


def test_lora_scorers_are_on_by_default() -> None:
    cfg = RouterConfig(model_dir="/m")
    assert ("lora-affinity", 1.0) in [(s.name, s.weight) for s in cfg.prefill_scorers]
    assert ("lora-affinity", 0.5) in [(s.name, s.weight) for s in cfg.decode_scorers]


async def test_admin_change_reaches_every_router_process(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    """``--procs 2``: a load taken by one process is in the other's table (told on its
    loopback port), and so is the unload; the sibling route answers nowhere else."""
    sql = write_adapter(tmp_path, "sql", 6)
    async with lora_cluster(router_tokenizer, tiny_model_dir) as (c, _):
        ports = (free_port(), free_port())
        async with contextlib.AsyncExitStack() as stack:
            urls = []
            for i, port in enumerate(ports):
                cfg = RouterConfig(
                    model_dir=str(tiny_model_dir),
                    served_model_name="tiny",
                    health_interval_s=0.2,
                    proc_index=i,
                    proc_metrics_ports=ports,
                    admin_api_keys=("boss",),
                )
                app = create_app(cfg, StaticSource(c.prefill_urls, c.decode_urls), router_tokenizer)
                urls.append(await stack.enter_async_context(serve(app, port)))
            async with httpx.AsyncClient(headers=ADMIN) as h:
                load = {"lora_name": "sql", "lora_path": str(sql)}
                r = await h.post(urls[0] + "/v1/load_lora_adapter", json=load)
                assert r.status_code == 200, r.text
                for url in urls:
                    ids = [m["id"] for m in (await h.get(url + "/v1/models")).json()["data"]]
                    assert ids == ["tiny", "sql"]
                r = await h.post(urls[1] + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
                assert r.status_code == 200, r.text
                for url in urls:
                    ids = [m["id"] for m in (await h.get(url + "/v1/models")).json()["data"]]
                    assert ids == ["tiny"]
                change = {"op": "add", "name": "x", "hash": "0" * 32, "path": "/x"}
                r = await h.post(c.url + "/internal/lora_table", json=change)
                assert r.status_code == 404  # the public port: no sibling there
        await c.settle()


async def test_a_worker_that_missed_a_load_is_told(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    """A decode worker restarted without the run-time adapter (its ``lora_known`` lacks it)
    gets it from the router after a health round; one that reads other files at that path
    is unloaded again, never left serving weights the router does not list."""
    sql = write_adapter(tmp_path, "sql", 7)
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir, n_decode=2, admin_api_keys=("boss",)) as (
            c,
            fakes,
        ),
        httpx.AsyncClient(base_url=c.url, headers=ADMIN) as h,
    ):
        load = {"lora_name": "sql", "lora_path": str(sql)}
        assert (await h.post("/v1/load_lora_adapter", json=load)).status_code == 200
        late, other = fakes[1], fakes[2]
        late.known.clear()  # "restarted"
        await _until(lambda: late.known == {"sql": adapter_hash(sql)})
        other.hash_override = "f" * 32
        other.known.clear()
        await _until(lambda: other.calls[-2:] == [("load", "sql"), ("unload", "sql")])
        assert other.known == {}
        # unloaded through the router: no worker is told to load it back
        r = await h.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200
        await asyncio.sleep(0.6)  # three health rounds
        assert all(f.known == {} for f in fakes)
        await c.settle()


async def test_load_and_unload_need_an_admin_key_even_without_tenant_keys(
    router_tokenizer, tiny_model_dir, tmp_path: Path
) -> None:
    """Issue 44 item 7: with no keys configured, load and unload were open to anyone who
    reached the router (the Ingress's /v1 prefix). Now: none configured → 403; an admin
    key configured but not sent → 401; a wrong one → 403; nothing reaches a worker."""
    load = {"lora_name": "sql", "lora_path": str(write_adapter(tmp_path, "sql", 5))}
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir) as (c, fakes),
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        for route, body in (
            ("/v1/load_lora_adapter", load),
            ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
        ):
            r = await h.post(route, json=body)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert all(not f.calls for f in fakes)
    async with (
        lora_cluster(router_tokenizer, tiny_model_dir, admin_api_keys=("boss",)) as (c, fakes),
        httpx.AsyncClient(base_url=c.url) as h,
    ):
        assert (await h.post("/v1/load_lora_adapter", json=load)).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        r = await h.post("/v1/load_lora_adapter", json=load, headers=wrong)
        assert r.status_code == 403
        assert all(not f.calls for f in fakes)
        r = await h.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
        assert r.status_code == 200, r.text
        await c.settle()
