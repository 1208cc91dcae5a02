"""The compiled lane (``--fast-lane``, router/fast_lane.py, rust/router_lane/) against the
Python lane, its reference: the same bytes where the Python lane defines them (signatures,
chunks, the whole reply), the same replies from the same fake workers, the requests it
declines answered by the Python lane behind it, and the completions tests of
test_api / test_migration / test_retries / test_stream_end / test_errors / test_tenants run
again through it (imported below: this module's ``cluster_factory`` starts the lane).

Skipped where the module is not built (scripts/setup.sh builds it when cargo is there).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse

from pdserve import keys, signing
from pdserve.protocol.codec import encode
from pdserve.protocol.contract import GenerateRequest, PrefillRequest
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.router import fast_lane
from pdserve.router.api import openai_response
from pdserve.testing.lane import lane_mod, needs_lane
from tests.router import (
    test_api,
    test_errors,
    test_migration,
    test_retries,
    test_stream_end,
    test_tenants,
)
from tests.router.conftest import start_cluster

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# The completions tests again, through the lane (this module's cluster_factory): the
# Python lane's tests are the compiled lane's oracle.
AGAIN = {
    test_api: (
        "test_completion_non_streaming_remote_prefill",
        "test_completion_short_prompt_goes_straight_to_decode",
        "test_completion_streaming_with_usage",
        "test_token_id_prompt_and_max_tokens_one",
    ),
    test_errors: (
        "test_api_key",
        "test_bad_parameters_name_the_field",
        "test_queue_full_is_429_with_retry_after",
    ),
    test_migration: (
        "test_a_decode_worker_that_keeps_failing_is_retried_a_bounded_number_of_times",
        "test_request_fault_mid_stream_is_not_migrated",
        "test_stream_moves_to_another_decode_worker",
        "test_stream_on_a_hung_worker_moves_on",
    ),
    test_retries: (
        "test_all_prefill_workers_down_falls_back_to_local_prefill",
        "test_decode_failure_before_first_token_is_retried",
        "test_failed_prefill_worker_is_retried_on_another",
        "test_non_streaming_client_disconnect_aborts_on_workers",
        "test_streaming_client_disconnect_aborts_on_workers",
    ),
    test_stream_end: ("test_done_goes_with_the_last_token",),
    # a declined stream (n = 16) relayed from the Python server: its slow reader is cut
    test_tenants: ("test_a_client_that_stops_reading_is_aborted_and_others_go_on",),
}
for _module, _names in AGAIN.items():
    for _name in _names:
        globals()[_name] = getattr(_module, _name)


@pytest.fixture
def cluster_factory(router_tokenizer, tiny_model_dir):
    if lane_mod is None:
        pytest.skip("the compiled lane is not built (scripts/setup.sh builds it with cargo)")

    def make(**kw: Any):
        return start_cluster(router_tokenizer, tiny_model_dir, lane=True, **kw)

    return make


KEY = keys.derive("a-secret", keys.HTTP)


@needs_lane
@pytest.mark.parametrize("body", [b"", b'{"request_id":"r"}'])
def test_signatures_are_pythons(monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    nonce = bytes(range(12))
    monkeypatch.setattr(signing.os, "urandom", lambda n: nonce)
    ring = keys.KeyRing(keys.HTTP, "a-secret")
    want = signing.sign(ring, "POST", "/prefill", body, now=1796650000.1234, host="10.0.0.7:8001")
    got = lane_mod.sign_with(KEY, "POST", "/prefill", body, 1796650000.1234, "10.0.0.7:8001", nonce)
    assert got == want
    proof = signing.proof(KEY, want)
    assert lane_mod.proof_ok([KEY], want, proof.encode())
    assert lane_mod.proof_ok([b"x" * 32, KEY], want, proof.upper().encode())  # any key, hex
    assert not lane_mod.proof_ok([KEY], want, proof[:-1].encode() + b"0")
    assert not lane_mod.proof_ok([KEY], want, None)
    assert lane_mod.proof_ok([], want, None)  # no secret: an unauthenticated deployment


@needs_lane
@pytest.mark.parametrize("salt", [None, "k:abc"])
def test_generate_request_is_the_codecs(salt: str | None) -> None:
    sampling = SamplingParams(max_tokens=7, stop=["é"], seed=3, logit_bias={5: -1.0})
    ids = [1, 2, 2**40]
    prefill = encode(PrefillRequest("cmpl-1", ids, sampling, salt, None))
    want = encode(GenerateRequest("cmpl-1", ids, sampling, None, None, salt))
    assert lane_mod.generate_request_of(prefill).encode() == want  # byte for byte
    resumed = encode(GenerateRequest("cmpl-1", ids, sampling, None, None, salt, [7, 8]))
    assert lane_mod.generate_request_of(prefill, "[7,8]").encode() == resumed


TEXTS = ["", "plain", 'quo"te\\', "new\nline\t\r\b\f", "é ünï", "emoji 😀", "\x00\x1f\x7f", "</a>"]


def _no_clock(text: str) -> str:
    return re.sub(r'"created":\d+', '"created":0', text)


@needs_lane
@pytest.mark.parametrize("text", TEXTS)
def test_chunks_are_pythons(text: str) -> None:
    rid, model = "cmpl-0123", 'ti"ny-é'
    for finish in (None, "length", "stop"):
        want = openai_response.TextChunks(rid, model, False)(text, finish)
        assert _no_clock(lane_mod.text_chunk(rid, model, text, finish)) == _no_clock(want)
    use = openai_response.usage(7, 3, 2)
    want = openai_response.chunk(rid, model, False, use=use)
    assert _no_clock(lane_mod.usage_chunk(rid, model, 7, 3, 2)) == _no_clock(want)
    whole = openai_response.full_response(rid, model, False, text, "length", use)
    want = bytes(JSONResponse(whole).body).decode()
    got = lane_mod.whole(rid, model, text, "length", 7, 3, 2)
    assert _no_clock(got) == _no_clock(want)


BODIES: list[dict[str, Any]] = [
    {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4},
    {"prompt": "hello there", "max_tokens": 3, "stream": True},
    {"prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
    {"prompt": "a b c", "max_tokens": 2, "temperature": 0, "seed": 3, "stop": ["zz"]},
]


def _comparable(raw: bytes) -> Any:
    """The reply without its id and clock; a stream as its text, finish reasons, usage and
    end (which tokens share a chunk depends on when the worker's lines arrive)."""
    text = re.sub(r'"cmpl-[0-9a-f]+"', '"cmpl-"', _no_clock(raw.decode()))
    if not text.startswith("data: "):
        return text
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    heads = {
        json.dumps({k: v for k, v in ch.items() if k not in ("choices", "usage")}) for ch in chunks
    }
    said = "".join(c["text"] for ch in chunks for c in ch["choices"])
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    return heads, said, finishes, [ch["usage"] for ch in chunks if "usage" in ch], events[-1]


async def _replies(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, str]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        for b in bodies:
            r = await h.post("/v1/completions", json={"model": "tiny", **b})
            out.append((r.status_code, _comparable(r.content)))
    return out


@needs_lane
@pytest.mark.parametrize("threshold", [0, 10_000], ids=["pd", "direct"])
async def test_lane_replies_as_the_python_lane(router_tokenizer, tiny_model_dir, threshold) -> None:
    got, itls = {}, {}
    for lane in (False, True):
        async with start_cluster(
            router_tokenizer, tiny_model_dir, lane=lane, disagg_threshold=threshold
        ) as c:
            got[lane] = await _replies(c.url, BODIES)
            await c.settle()
            async with httpx.AsyncClient() as h:
                text = (await h.get(c.url + "/metrics")).text
            # the inter-token latencies: the lane counts them in Rust, folded in on scrape
            itls[lane] = re.findall(r"^pdserve_router_itl_seconds_count (\S+)$", text, re.M)
            if lane:  # the lane served them all, and counted them as the Python lane does
                assert c.app.state.lane.host.served == len(BODIES)
                assert 'pdserve_router_requests_total{code="200"} 4.0' in text
                assert "pdserve_router_ttft_seconds_count 4.0" in text
            assert c.runtime.active == 0
    assert got[True] == got[False]
    # one per token after each request's first (14 tokens, 4 firsts) on both lanes,
    # whichever tokens a read merged into one delta (Dispatcher._delta, lane.rs delta)
    assert itls[True] == itls[False] == ["10.0"]
    assert all(status == 200 for status, _ in got[True])


DECLINED: list[dict[str, Any]] = [
    {"prompt": "hi", "max_tokens": 2, "n": 2},
    {"prompt": "hi", "max_tokens": 2, "echo": True},
    {"prompt": ["not", "ids"], "max_tokens": 2},  # an error: the Python lane's words
    {"prompt": "hi", "max_tokens": -1},
]


@needs_lane
async def test_declined_requests_are_the_python_lanes(router_tokenizer, tiny_model_dir) -> None:
    got = {}
    for lane in (False, True):
        async with start_cluster(router_tokenizer, tiny_model_dir, lane=lane) as c:
            got[lane] = await _replies(c.url, DECLINED)
            async with httpx.AsyncClient(base_url=c.url) as h:
                chat = await h.post(
                    "/v1/chat/completions",
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                )
                models = await h.get("/v1/models")
            got[lane] += [(chat.status_code, chat.json()["object"]), (models.status_code, "")]
            if lane:
                assert c.app.state.lane.host.served == 0
            await c.settle()
    assert got[True] == got[False]
    assert [s for s, _ in got[True]] == [200, 200, 400, 400, 200, 200]


@needs_lane
async def test_budget_peers_keep_their_limits_on_the_python_lane(
    router_tokenizer, tiny_model_dir
) -> None:
    """--budget-peers counts a key at its owner (awaited calls the lane does not make): the
    lane passes every request on, so the per-key cap still holds."""
    own = "http://127.0.0.1:9"  # the only peer: every key's owner is this replica
    async with start_cluster(
        router_tokenizer,
        tiny_model_dir,
        lane=True,
        budget_peers=(own,),
        budget_self=own,
        max_concurrency_per_key=1,
    ) as c:
        got = await _replies(c.url, BODIES[:2])
        assert [s for s, _ in got] == [200, 200]
        assert c.app.state.lane.host.served == 0
        assert c.runtime.peers is not None
        await c.settle()
        assert c.runtime.active == 0


async def _echo_scope(scope: Any, receive: Any, send: Any) -> None:
    _echo_scope.seen = scope  # type: ignore[attr-defined]


async def test_lane_peer_is_believed_only_with_the_token() -> None:
    peer = fast_lane.LanePeer(_echo_scope, "t0ken", ("0.0.0.0", 8000))
    base = {"type": "http", "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 4444)}
    forged = [(b"x-pdserve-lane-peer", b"10.9.9.9:1"), (b"x-pdserve-lane-token", b"guess")]
    await peer({**base, "headers": [(b"host", b"h"), *forged]}, None, None)
    seen = _echo_scope.seen  # type: ignore[attr-defined]
    assert seen["client"] == ("127.0.0.1", 5555) and seen["headers"] == [(b"host", b"h")]
    sent = [(b"x-pdserve-lane-peer", b"[::1]:7"), (b"x-pdserve-lane-token", b"t0ken")]
    await peer({**base, "headers": sent}, None, None)
    seen = _echo_scope.seen  # type: ignore[attr-defined]
    assert seen["client"] == ("::1", 7) and seen["server"] == ("0.0.0.0", 8000)
    assert seen["headers"] == []


def test_without_the_module_the_python_lane_serves_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No cargo at setup (or a failed build): --fast-lane logs why and changes nothing."""
    import sys

    from pdserve.router import main

    monkeypatch.setitem(sys.modules, "pdserve_lane", None)  # the import fails
    args = main.argparse.Namespace(fast_lane=True, host="127.0.0.1", port=0)
    with caplog.at_level("WARNING"):
        assert main._fast_lane(args, False) is None
    assert "the compiled lane is not installed" in caplog.text
    assert "serving on the Python lane" in caplog.text


def test_an_out_of_date_build_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A module built from an older tree (a failed rebuild leaves the last one installed)
    takes other arguments and answers other jobs: the Python lane serves, and says why."""
    import sys
    import types

    old = types.ModuleType("pdserve_lane")
    old.Lane = type("Lane", (), {})  # type: ignore[attr-defined]  # no tokenize
    monkeypatch.setitem(sys.modules, "pdserve_lane", old)
    with caplog.at_level("WARNING"):
        assert fast_lane.load() is None
    assert "out of date" in caplog.text and "serving on the Python lane" in caplog.text


@needs_lane
def test_a_batch_of_tracks_is_summed_per_worker() -> None:
    """The loop reads the in-flight counts once a batch: its tracks reach Python as one
    net (url, role, calls, prompt tokens) per worker call site, a call begun and ended in
    the batch cancelled out, a site whose calls net to nothing left out."""
    a, b = "http://a", "http://b"
    tracks = [
        (1, a, "prefill", 1, 64),
        (2, b, "decode", 1, 0),
        (1, a, "prefill", -1, 64),  # with 1's +1: nothing left on a
        (1, b, "decode", 1, 0),
        (2, b, "decode", -1, 0),
        (3, a, "decode", -1, 0),  # its +1 came in an earlier batch
        (4, b, "prefill", 1, 10),
        (5, b, "prefill", -1, 30),  # its +1 came earlier: net 0 calls, -20 tokens
    ]
    assert lane_mod.netted_tracks(tracks) == [
        (b, "decode", 1, 0),
        (a, "decode", -1, 0),
        (b, "prefill", 0, -20),
    ]
    assert lane_mod.netted_tracks(tracks[:1]) == [(a, "prefill", 1, 64)]
    assert lane_mod.netted_tracks(tracks[:3:2]) == []
