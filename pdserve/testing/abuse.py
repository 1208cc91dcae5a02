"""One abuse battery, what one tenant key tries against a router (issue 44 item 2): the
suite runs it against both modes (tests/router/test_abuse_both_modes.py) and
bench/chaos_isolation.py counts what the endpoint picker lets through."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.testing.picker import completion

LIMITS = {
    "api_keys": ("ka", "kb", "kc", "kd"),
    "rate_limit_rpm": 2,
    "rate_limit_tpm": 500,
    "max_concurrency_per_key": 1,
    "max_body_bytes": 4096,
    "max_waiting": 0,
}
Send = Callable[[str, bytes], Awaitable[int]]
Hold = Callable[[str], Awaitable[Callable[[], Awaitable[None]]]]


def request_body(max_tokens: int = 4, prompt: str = "hello") -> bytes:
    return completion(prompt, max_tokens=max_tokens, stream=False)


async def battery(send: Send, hold: Hold) -> list[tuple[str, int, int]]:
    """(case, expected, got) for each attack; a mode passes when every got == expected."""
    out = [
        ("no key", 401, await send("", request_body())),
        ("a wrong key", 401, await send("nope", request_body())),
    ]
    codes = [await send("ka", request_body()) for _ in range(3)]
    out.append(("rpm 2: the third request", 429, codes[2]))
    await send("kb", request_body(300))  # ~302 of the 500 tokens
    out.append(
        ("tpm 500: a second request of 300 tokens", 429, await send("kb", request_body(300)))
    )
    out.append(("an 8 KiB body over 4 KiB", 413, await send("kc", request_body(prompt="x" * 8192))))
    release = await hold("kd")  # one request of kd in flight
    out.append(("per-key concurrency 1: a second", 429, await send("kd", request_body())))
    await release()
    return out


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def picker_mode(factory: Any) -> list[tuple[str, int, int]]:
    async with factory(**LIMITS) as pc:

        async def send(key: str, body: bytes) -> int:
            env = pc.envoy()
            routed = await env.request("/v1/completions", body, headers=auth(key))
            env.close()
            if not routed.status:  # routed: the gateway would carry it; done at once
                await asyncio.sleep(0.05)
            return routed.status or 200

        async def hold(key: str) -> Callable[[], Awaitable[None]]:
            env = pc.envoy()  # routed, and its response never ends: the pick is held
            routed = await env.request("/v1/completions", request_body(), headers=auth(key))
            assert routed.endpoints, routed

            async def release() -> None:
                env.close()

            return release

        result = await battery(send, hold)
        await pc.settle()
        return result


async def picker_mode_bypasses(factory: Any) -> int:
    """How many of the battery's attacks the picker lets through (bench/chaos.py:
    picker_mode_limit_bypass)."""
    return sum(exp != got for _, exp, got in await picker_mode(factory))
