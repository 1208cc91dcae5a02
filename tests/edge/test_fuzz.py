"""Property-based fuzzing of the OpenAI API through the router into real workers.

Hypothesis draws request bodies (mostly well-formed, with wild values in every
field: huge and negative integers, NaN and infinities, lone surrogates, nested
junk, raw non-JSON bytes). Every answer must be a 2xx, or a 4xx with OpenAI's
error body; never a 5xx, never an error event inside a stream. Meanwhile three
other clients stream without pause, and every one of their streams must finish
whole. Bounded: 100 examples, well under a minute here; ends with every KV
block free.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.testing.loopback import all_kv_free

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

BIG = [2**63, 2**64 + 1, -(2**63) - 1, 10**30, -1, 0, 1]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(BIG),
    st.integers(-5, 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(), max_size=12),
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def mostly(valid: Any, junk_too: Any = junk) -> Any:
    """``valid`` nine times in ten, else junk: most requests get far enough to run."""
    return st.integers(0, 9).flatmap(lambda i: valid if i else junk_too)


# st.characters() includes lone surrogates (category Cs): json.dumps writes \udXXX escapes.
wild_text = st.text(st.characters(), max_size=40)
texts = mostly(
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40), wild_text
)
FIELDS = {
    "max_tokens": mostly(st.integers(1, 6)),
    "max_completion_tokens": mostly(st.integers(1, 6)),
    "temperature": mostly(st.floats(0, 2)),
    "top_p": mostly(st.floats(0.01, 1)),
    "top_k": mostly(st.integers(-1, 100)),
    "seed": mostly(st.integers(-(2**63), 2**64 - 1), st.sampled_from(BIG) | junk),
    "min_tokens": mostly(st.integers(0, 1)),
    "stop": mostly(texts | st.lists(texts, max_size=4)),
    "stop_token_ids": mostly(st.lists(st.integers(0, 500), max_size=4)),
    "ignore_eos": mostly(st.booleans()),
    "n": mostly(st.just(1)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logprobs": mostly(st.sampled_from([None, False, True, 0, 2])),
    "echo": mostly(st.sampled_from([None, False])),
    "user": mostly(texts),
    "cache_salt": mostly(texts),
    # issue 12's fields: penalties, biases, log-probabilities, structured outputs
    "presence_penalty": mostly(st.floats(-2, 2)),
    "frequency_penalty": mostly(st.floats(-2, 2)),
    "repetition_penalty": mostly(st.floats(0.5, 2)),
    "min_p": mostly(st.floats(0, 1)),
    "logit_bias": mostly(
        st.dictionaries(st.integers(0, 70_000).map(str), st.floats(-100, 100), max_size=3)
    ),
    "top_logprobs": mostly(st.integers(0, 5)),
    "response_format": mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
}
roles = mostly(st.sampled_from(["system", "user", "assistant"]))
parts = st.lists(
    st.fixed_dictionaries({"type": mostly(st.just("text")), "text": texts}), min_size=1, max_size=2
)
message = st.fixed_dictionaries({"role": roles, "content": mostly(texts | parts)})
messages = mostly(st.lists(message, min_size=1, max_size=3))
prompts = mostly(
    texts | st.lists(st.integers(0, 500), min_size=1, max_size=30),
    st.lists(st.integers(-3, 10**6), max_size=30) | junk,
)


@st.composite
def bodies(draw: Any) -> tuple[bool, bytes]:
    """(chat?, raw body). One in ten is not an OpenAI object at all."""
    chat = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.binary(max_size=64) | junk.map(lambda j: json.dumps(j).encode()))
        return chat, raw
    body: dict[str, Any] = {"model": draw(mostly(st.just("tiny-seed0")))}
    body["messages" if chat else "prompt"] = draw(messages if chat else prompts)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True)):
        body[name] = draw(FIELDS[name])
    return chat, json.dumps(body).encode()


def _check(resp: httpx.Response, stream_text: str) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    elif stream_text:
        assert '"error"' not in stream_text, stream_text[-500:]
        assert stream_text.rstrip().endswith("data: [DONE]"), stream_text[-200:]


class Others:
    """Three clients streaming greedy requests back to back while the fuzz runs."""

    def __init__(self, dep: Any) -> None:
        self.dep, self.stop, self.done, self.failures = dep, threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(3)]

    def _run(self, i: int) -> None:
        body = {
            "model": self.dep.model,
            "prompt": f"other client {i}: " + "la " * 40 * i,
            "max_tokens": 30,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(base_url=self.dep.url, timeout=120, headers=self.dep.headers()) as h:
            while not self.stop.is_set():
                with h.stream("POST", "/v1/completions", json=body) as r:
                    text = "".join(r.iter_text())
                if (
                    r.status_code != 200
                    or '"error"' in text
                    or '"completion_tokens":30' not in text
                ):
                    self.failures.append((r.status_code, text[-300:]))
                self.done += 1

    def __enter__(self) -> Others:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_fuzzed_requests_never_5xx_nor_hurt_others(deployment) -> None:
    dep = deployment
    client = httpx.Client(base_url=dep.url, timeout=120, headers=dep.headers())
    statuses: list[int] = []

    @settings(
        max_examples=100,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(bodies())
    def fuzz(case: tuple[bool, bytes]) -> None:
        chat, raw = case
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with client.stream(
            "POST", path, content=raw, headers={"content-type": "application/json"}
        ) as resp:
            text = "".join(resp.iter_text())
        statuses.append(resp.status_code)
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            _check(resp, text)
        else:
            _check(httpx.Response(resp.status_code, content=text.encode()), "")

    t0 = time.monotonic()
    with client, Others(dep) as others:
        fuzz()
    took = time.monotonic() - t0
    ok = sum(s == 200 for s in statuses)
    print(
        f"fuzz: {len(statuses)} requests in {took:.1f}s, {ok} served, "
        f"{len(statuses) - ok} refused; {others.done} other streams"
    )
    assert ok >= 10 and len(statuses) - ok >= 10  # both sides of the edge were exercised
    assert others.failures == [] and others.done >= 3, (others.done, others.failures[:3])
    all_kv_free(list(dep.workers))
