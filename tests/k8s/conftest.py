"""Fixtures for the Kubernetes tests: the CRD, an emulated API server, the operator.

No cluster can run here: the operator runs for real (kopf, in-process) against
the kmock emulator (``emulator.ApiServer``). The emulator has no controllers, so
tests play the Deployment controller by patching Deployment ``status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
import kmock
import kopf
import pytest
import yaml
from k8s_helpers import NS, TEST_POD_POLICY
from k8s_slices import Slices

from pdserve.operator.cache import WATCHED
from pdserve.operator.handlers import OperatorConfig
from pdserve.operator.kube import KubeClient
from pdserve.operator.main import build_registry
from pdserve.operator.pod_policy import PodPolicy
from pdserve.testing.k8s_emulator import ApiServer


class ForeignTasks(Collection["asyncio.Task[Any]"]):
    """Every task not running kopf's own code (tests, the emulator): kopf must not reap them."""

    def __contains__(self, task: object) -> bool:
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        code = getattr(coro, "cr_code", None)
        return code is None or "/kopf/" not in code.co_filename

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(())

    def __len__(self) -> int:
        return 0


@pytest.fixture
async def api_server() -> AsyncIterator[ApiServer]:
    async with ApiServer() as server, kmock.Server(server):
        server.resources["pdserve.io/v1alpha1/llmservices"] = kmock.ResourceInfo(
            kind="LLMService",
            singular="llmservice",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            subresources={"status"},
        )
        # The children the operator watches (cache.WATCHED): kopf discovers them first.
        for w in WATCHED:
            server.resources[f"{w.api_version}/{w.plural}"] = kmock.ResourceInfo(
                kind=w.kind,
                namespaced=True,
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
            )
        # The router's discovery watches these (resourceVersion semantics: k8s_history.py).
        server.resources["discovery.k8s.io/v1/endpointslices"] = kmock.ResourceInfo(
            kind="EndpointSlice",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )
        # kopf's peering (HA): one KopfPeering per watched namespace, status = the peers.
        server.resources["kopf.dev/v1/kopfpeerings"] = kmock.ResourceInfo(
            kind="KopfPeering",
            namespaced=True,
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        )
        # kopf's backbone: it waits for these to be discoverable before it starts watching.
        read = {"get", "list", "watch"}
        server.resources["v1/namespaces"] = kmock.ResourceInfo(
            kind="Namespace", namespaced=False, verbs=read
        )
        server.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs=read
        )
        yield server


@pytest.fixture
def kubeconfig(
    api_server: ApiServer, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """A kubeconfig pointing at the emulator; the operator reads $KUBECONFIG at login time."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emu", "cluster": {"server": str(api_server.url).rstrip("/")}}],
        "users": [{"name": "tester", "user": {"token": "test-token"}}],
        "contexts": [
            {"name": "emu", "context": {"cluster": "emu", "user": "tester", "namespace": NS}}
        ],
        "current-context": "emu",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return str(path)


@pytest.fixture
async def client(api_server: ApiServer) -> AsyncIterator[KubeClient]:
    info = kopf.ConnectionInfo(server=str(api_server.url).rstrip("/"))
    c = KubeClient(info)
    yield c
    await c.close()


@contextlib.asynccontextmanager
async def running_operator(
    config: OperatorConfig | None = None, peering: str = "", priority: int = 0
) -> AsyncIterator[None]:
    """The real operator (kopf + our handlers) as a task in this event loop; with ``peering``
    one of several replicas (the highest ``priority`` is active, the others stand by)."""
    config = config or OperatorConfig(status_interval=0.3, retry_delay=0.5, debounce=0.05)
    if config.pod_policy == PodPolicy():  # minimal_llmservice's weights are on a hostPath
        config = dataclasses.replace(config, pod_policy=TEST_POD_POLICY)
    stop, ready = asyncio.Event(), asyncio.Event()

    async def run_operator() -> None:
        # kopf.operator() would wait 5 s at exit for "hung" tasks, counting pytest's own
        # teardown task among them; run_tasks() with our exclusion list waits for kopf's only.
        tasks = await kopf.spawn_tasks(
            registry=build_registry(config),
            namespaces=[NS],
            standalone=not peering,
            peering_name=peering or None,
            priority=priority,
            stop_flag=stop,
            ready_flag=ready,
        )
        await kopf.run_tasks(tasks, ignored=ForeignTasks())

    task = asyncio.create_task(run_operator())
    await asyncio.wait_for(ready.wait(), timeout=10)
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)


@pytest.fixture
def start_operator(kubeconfig: str) -> Callable[[], AbstractAsyncContextManager[None]]:
    """For tests that stop and restart the operator themselves."""
    return running_operator


@pytest.fixture
async def operator(kubeconfig: str) -> AsyncIterator[None]:
    async with running_operator():
        yield


@pytest.fixture
async def slices(api_server: ApiServer) -> AsyncIterator[Slices]:
    async with aiohttp.ClientSession(headers={"User-Agent": "controller"}) as session:
        yield Slices(api_server, session)
