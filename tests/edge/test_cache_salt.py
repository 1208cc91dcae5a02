"""Prefix-cache isolation per tenant on real workers: the API key's salt and the
request's ``cache_salt`` enter the block hashes, so ``cached_tokens`` shows a
tenant its own cached prompts and nothing of another tenant's."""

from __future__ import annotations

import uuid

import httpx
import pytest

from pdserve.protocol.hashing import ROOT_HASH, block_hashes, salt_root
from pdserve.testing.loopback import all_kv_free, secret_auth

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.mark.unit
def test_salt_changes_every_block_hash() -> None:
    ids = list(range(64))
    plain, a, b = (block_hashes(ids, 16, salt_root(s)) for s in (None, "a", "b"))
    assert salt_root(None) == salt_root("") == ROOT_HASH
    assert block_hashes(ids, 16, salt_root("a")) == a  # stable
    assert not set(plain) & set(a) and not set(a) & set(b)


def _cached(h: httpx.Client, model: str, prompt: str, tenant: int, **extra: object) -> int:
    from tests.edge.conftest import KEYS

    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    r = h.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("words", [120, 14], ids=["remote-prefill", "local-prefill"])
def test_tenants_do_not_see_each_others_cache(deployment, words: int) -> None:
    dep = deployment
    prompt = f"{uuid.uuid4().hex} " + "the same system prompt for everyone " * (words // 6)
    with httpx.Client(base_url=dep.url, timeout=60) as h:
        assert _cached(h, dep.model, prompt, 0) == 0
        assert _cached(h, dep.model, prompt, 0) > 0  # tenant A hits its own cache
        assert _cached(h, dep.model, prompt, 1) == 0  # tenant B learns nothing of A's
        assert _cached(h, dep.model, prompt, 1) > 0
        # a request's own cache_salt: a cache of its own inside the tenant
        assert _cached(h, dep.model, prompt, 0, cache_salt="doc-7") == 0
        assert _cached(h, dep.model, prompt, 0, cache_salt="doc-7") > 0
        assert _cached(h, dep.model, prompt, 1, cache_salt="doc-7") == 0
    all_kv_free(list(dep.workers))


def test_bad_cache_salt_is_refused(deployment) -> None:
    dep = deployment
    with httpx.Client(timeout=30) as h:
        for salt in (5, "", "s" * 300):
            body = {"model": dep.model, "prompt": "hi", "cache_salt": salt}
            r = h.post(dep.url + "/v1/completions", json=body, headers=dep.headers())
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        for url, path, kind in (
            (dep.workers[0], "/prefill", "prefill_request"),
            (dep.workers[1], "/generate", "generate_request"),
        ):
            body = {
                "type": kind,
                "request_id": "salty",
                "prompt_token_ids": [1, 2, 3],
                "sampling": {"max_tokens": 2},
                "cache_salt": ["x"],
            }
            r = h.post(url + path, json=body, auth=secret_auth())
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
