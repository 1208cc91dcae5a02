"""``pdserve up`` (1 prefill + 1 decode, float32) on loopback for the conformance tests.

One cluster for the whole session, started by the first module that asks for it: the
fixtures ``up`` (the cluster; every KV block must be free again after each module) and
``client`` (an OpenAI client on it), which tests/router/conftest.py offers every router
test module; :func:`run_up` for a module that needs other flags. The modules on it only
read from the service (no kills, no flags of their own) and measure counters as deltas, so
sharing it saves one ``pdserve up`` start per module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.testing.loopback import all_kv_free, secret_auth
from pdserve.testing.up import Up, running_up, suite_flags
from tests.early_release import released_after_last_user

# Prompts at least this long (in tokens) are prefilled on the prefill worker: the tests'
# prompts are longer, so every request crosses the P/D hand-off.
DISAGG_THRESHOLD = 8


@contextlib.contextmanager
def run_up(model_dir: Path, log_dir: Path, *extra: str) -> Iterator[Up]:
    flags = ("--dtype", "float32", "--disagg-threshold", str(DISAGG_THRESHOLD), *extra)
    with running_up(model_dir, *suite_flags(log_dir), *flags) as up:
        yield up


def worker_stats(up: Up, role: str) -> dict[str, Any]:
    """The /stats (an internal route) of the one worker of ``role``: up.workers lists them
    in the order they became ready, which is not fixed."""
    for url in up.workers:
        stats = httpx.get(url + "/stats", auth=secret_auth()).json()
        if stats["role"] == role:
            return {"url": url, **stats}
    raise AssertionError(f"no {role} worker in {up.workers}")


def four_choices(client: openai.OpenAI, model: str) -> Any:
    """A completion of four sampled choices (n=4) of one 41-token prompt: 2 full blocks of
    16, fresh to every cache."""
    return client.completions.create(
        model=model,
        prompt=[0, *range(900, 940)],
        max_tokens=8,
        n=4,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )


async def greedy_ids(
    url: str, model: str, prompt: Any, max_tokens: int, key: str = "none"
) -> tuple[list[int], int]:
    """(token ids, cached prompt tokens) of one greedy completion through the router at
    ``url`` (the ids as the router returns them: ``return_tokens_as_token_ids``)."""
    cl = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    out = await cl.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=0,
        extra_body=extra,
    )
    await cl.close()
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    details = out.usage.prompt_tokens_details if out.usage else None
    return ids, (details.cached_tokens or 0) if details else 0


# Started once per run by its first user (~50 s on a loaded machine: the slowest "setup" in
# --durations, charged to whichever test comes first); make test keeps all its users on one
# xdist worker (tests/xdist_plan.py: group shared-up), so it never starts twice. Stopped
# after its last user (tests/early_release.py).
@pytest.fixture(scope="session")
def shared_up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    with released_after_last_user("shared_up") as stack:
        cluster = stack.enter_context(run_up(tiny_model_dir, tmp_path_factory.mktemp("up-logs")))
        assert len(cluster.workers) == 2, cluster.workers  # one prefill, one decode
        yield cluster


@pytest.fixture(scope="module")
def up(shared_up: Up) -> Iterator[Up]:
    assert shared_up.proc.poll() is None, "the shared pdserve up has exited"
    yield shared_up
    all_kv_free(shared_up.workers)  # after the module's last test, too


@pytest.fixture(scope="module")
def client(up: Up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0, timeout=300)
