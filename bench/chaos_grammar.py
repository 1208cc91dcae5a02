"""bench/chaos.py's grammar attacks (issue 24 item 3): structured outputs as a weapon.

- pathological specs: a schema nested 200 levels, an enum of 100,000 values, a regex of
  nested bounded repetitions, 600 tools under ``tool_choice: required``; each must be
  answered 200 or 400 (``grammar_5xx``: how many were not 2xx/4xx);
- while they compile, other clients' greedy streams keep their pace
  (``grammar_stalled_others``: streams that failed or took more than 4x their solo time
  plus 2 s);
- aborts around the compile: requests with a schema not seen before (so it must be
  compiled) that would decode for seconds, closed by their clients within 50 ms; a request
  the engine added after its abort would decode for nobody (``compile_abort_leaked``:
  requests still on a worker once the clients are gone).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import chaos_client as cc
import httpx
from chaos_service import Service, stats

# A regex of nested bounded repetitions: a large automaton if expanded naively.
NESTED_REGEX = "((a{1,40}b){1,40}c){1,20}"


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    }


def pathological() -> list[dict[str, Any]]:
    tool = {"type": "object", "properties": {"x": {"type": "string"}}}
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": tool}} for i in range(600)
    ]
    return [
        _schema(_deep(200)),
        _schema({"type": "string", "enum": [f"v{i}" for i in range(100_000)]}),
        _schema({"type": "string", "pattern": NESTED_REGEX}),
        {"guided_regex": NESTED_REGEX},
        {"tools": tools, "tool_choice": "required"},
    ]


async def phase_grammar(h: httpx.AsyncClient, model: str, n: int) -> dict[str, Any]:
    chat = {"model": model, "messages": [{"role": "user", "content": "answer"}], "max_tokens": 8}
    greedy = {
        "model": model,
        "prompt": "the quiet hill",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    solo = await cc.stream(h, "/v1/completions", greedy)
    solo_s = time.perf_counter() - t0

    async def timed() -> tuple[cc.Result, float]:
        t = time.perf_counter()
        r = await cc.stream(h, "/v1/completions", greedy)
        return r, time.perf_counter() - t

    attacks = [cc.post(h, "/v1/chat/completions", {**chat, **spec}) for spec in pathological()]
    results = await asyncio.gather(*attacks, *(timed() for _ in range(n)))
    answers: list[cc.Result] = results[: len(attacks)]  # type: ignore[assignment]
    others: list[tuple[cc.Result, float]] = results[len(attacks) :]  # type: ignore[assignment]
    bound = 4 * solo_s + 2.0
    return {
        "grammar_specs": len(answers),
        "grammar_5xx": sum(r.status >= 500 or r.status == 0 for r in answers),
        "grammar_statuses": sorted(r.status for r in answers),
        "grammar_solo_s": round(solo_s, 2),
        "grammar_stalled_others": sum(not r.ok(24) or s > bound for r, s in others)
        + (not solo.ok(24)),
    }


async def phase_compile_abort(h: httpx.AsyncClient, svc: Service, model: str, n: int) -> dict:
    async def one(i: int) -> cc.Result:
        # A schema never compiled before (its title is new), closed by its client within
        # 50 ms: on the way in, while its grammar compiles, or just after. At least 400
        # array items keep a request that is wrongly left running decoding for seconds.
        # (xgrammar compiles this in milliseconds on the tiny model's vocabulary, so the
        # abort-while-compiling race itself is pinned by tests/engine/test_grammar_bounds.py,
        # which holds the compile until after the abort.)
        schema = {
            "type": "array",
            "items": {"type": "integer"},
            "minItems": 400,
            "title": f"abort-{time.time_ns()}-{i}",
        }
        body = {"model": model, "prompt": "the field", "max_tokens": 1000, **_schema(schema)}
        return await cc.post(h, "/v1/completions", body, cancel_after_s=0.01 + 0.005 * i)

    results = await asyncio.gather(*(one(i) for i in range(n)))
    leaked = await asyncio.to_thread(_on_workers, svc, 1.0, 3.0)
    return {
        "compile_aborts": sum(r.cancelled for r in results),
        "compile_abort_leaked": leaked,
        "compile_abort_answered": sorted(
            {f"{r.status} {r.error[:80]}" for r in results if not r.cancelled}
        ),
    }


def _on_workers(svc: Service, settle_s: float, watch_s: float) -> int:
    """The most requests seen running or waiting on the workers over ``watch_s`` s, once
    ``settle_s`` s have passed with no client (time for the aborts to arrive)."""
    time.sleep(settle_s)
    most, deadline = 0, time.monotonic() + watch_s
    while time.monotonic() < deadline:
        on = [s for s in (stats(u) for u in svc.workers.values()) if s is not None]
        most = max(most, sum(int(s.get("running", 0)) + int(s.get("waiting", 0)) for s in on))
        time.sleep(0.25)
    return most
