"""A router in front of fake workers, all on 127.0.0.1 in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.coalesce import CoalescingHttpTools
from pdserve.env import SERVICE_SECRET
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.discovery.workers import StaticSource
from pdserve.router.tokenizer import PromptTokenizer
from pdserve.testing.router_fakes import (
    SECRET,
    TOTAL_BLOCKS,
    Fakes,
    FakeState,
    serve,
    start_fakes,
)

# The pdserve-up cluster fixtures (up, client) for the modules that run real workers.
from tests.router.pdserve_up import client, shared_up, up  # noqa: F401


@pytest.fixture(autouse=True)
def service_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router under test sends the fakes' secret (read when its session is made)."""
    monkeypatch.setenv(SERVICE_SECRET, SECRET)


@dataclass
class Cluster:
    url: str
    prefill: list[FakeState]
    decode: list[FakeState]
    prefill_urls: list[str]
    decode_urls: list[str]
    app: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime

    async def settle(self, timeout: float = 5.0) -> None:
        """Wait until every fake worker holds no lease and no active request."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.all_free():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"KV not freed: {self.leftovers()}")
            await asyncio.sleep(0.02)

    def all_free(self) -> bool:
        return all(st.kv_blocks_free == TOTAL_BLOCKS for st in self.prefill + self.decode)

    def leftovers(self) -> dict[str, Any]:
        return {st.worker_id: (st.leases, st.active) for st in self.prefill + self.decode}


@pytest.fixture(scope="session")
def router_tokenizer(tiny_model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer(str(tiny_model_dir))


# (stack, n_prefill, n_decode) -> fake workers served until the stack closes
MakeFakes = Callable[[contextlib.AsyncExitStack, int, int], Awaitable[Fakes]]


@contextlib.asynccontextmanager
async def start_cluster(
    tokenizer: PromptTokenizer,
    model_dir: Path,
    n_prefill: int = 1,
    n_decode: int = 1,
    http: Any = CoalescingHttpTools,
    fakes: MakeFakes | None = None,
    lane: bool = False,
    **cfg: Any,
) -> AsyncIterator[Cluster]:
    """A router over ``n_prefill`` + ``n_decode`` fake workers (``start_fakes``'s, or those
    ``fakes`` starts), served until the context ends."""
    async with contextlib.AsyncExitStack() as stack:
        f = await (fakes or start_fakes)(stack, n_prefill, n_decode)
        config = RouterConfig(
            model_dir=str(model_dir), served_model_name="tiny", health_interval_s=0.2, **cfg
        )
        app = create_app(config, StaticSource(f.prefill_urls, f.decode_urls), tokenizer)
        # by default the protocol `pdserve router` serves with (the client watch has no task
        # there); test_retries' disconnect tests run another server's path too (h11)
        if lane:  # the compiled lane in front (router/fast_lane.py), uvicorn behind it
            url = await stack.enter_async_context(serve_with_lane(app, http))
        else:
            url = await stack.enter_async_context(serve(app, http=http))
        yield Cluster(url, f.prefill, f.decode, f.prefill_urls, f.decode_urls, app)


@contextlib.asynccontextmanager
async def serve_with_lane(app: Any, http: Any) -> AsyncIterator[str]:
    from pdserve.router import fast_lane

    module = fast_lane.load()
    if module is None:
        pytest.skip("the compiled lane is not built (scripts/setup.sh builds it with cargo)")
    public, backend = socket.socket(), socket.socket()
    public.bind(("127.0.0.1", 0))
    backend.bind(("127.0.0.1", 0))
    setup = fast_lane.setup(module, public, backend)
    app.state.lane_setup = setup
    public = setup.public.getsockname()[1]
    setup.backend_socket.close()  # uvicorn binds the port again  # type: ignore[attr-defined]
    peer = fast_lane.LanePeer(app, setup.token, ("127.0.0.1", public))
    async with serve(peer, port=setup.backend[1], http=http):
        yield f"http://127.0.0.1:{public}"


@pytest.fixture
def cluster_factory(router_tokenizer: PromptTokenizer, tiny_model_dir: Path):
    def make(**kw: Any):
        return start_cluster(router_tokenizer, tiny_model_dir, **kw)

    return make
