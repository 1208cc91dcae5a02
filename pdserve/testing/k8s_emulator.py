"""kmock's Kubernetes emulator, extended with what kopf and the operator rely on.

kmock keeps objects in memory and serves list/watch/get/create/patch/delete,
but (as of 0.8) it sets no uid/resourceVersion/generation/creationTimestamp,
knows only merge patches, and treats ``/status`` like the main resource. This
subclass adds, as a real API server does:
- uid, resourceVersion, generation, creationTimestamp on create;
- a new resourceVersion on every patch; generation + 1 when ``spec`` changes;
- JSON patch (kopf's finalizer updates) with the ``test`` op → HTTP 422 on conflict;
- status-subresource semantics: ``/status`` patches change only ``status``,
  main-resource patches never change ``status`` (of kinds that have the subresource);
- the scale subresource: a ``/scale`` patch changes only ``spec.replicas`` (refused with a
  422 unless a count >= 0) and answers an autoscaling/v1 Scale;
- ``GET /api/v1/namespaces`` (list and watch), which kmock 0.8 cannot parse;
- one built-in validation, as an example of what only the API server knows: a Deployment
  whose ``nodeSelector`` holds an invalid label value is refused with a 422 and the
  API server's message;
- a count of requests by (method, watch?) in ``requests`` and by (User-Agent product,
  method, watch?) in ``by_agent`` (bench/operator_load.py counts the operator's), and by
  (method, resource plural) in ``by_method_resource`` (which kinds the operator reads);
- for the kinds in ``versioned`` (EndpointSlices), list/watch at a resourceVersion, label
  selectors, watch timeouts and 410 Gone (``k8s_history.py``);
- a bounded request log (kmock's grows for ever and makes each request cost O(all served));
- ``outage``: while set to an HTTP status, every request is answered with it (an API
  server that is down or overloaded).
Still missing (the tests account for it): garbage collection, CRD schema validation.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import itertools
import json
import re
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock

from pdserve.testing.k8s_history import History, matches, rv_of, watch_from


def merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch that turns ``old`` into ``new`` (None removes a key)."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            sub = merge_diff(old[k], v)
            if sub:
                out[k] = sub
        elif k not in old or old[k] != v:
            out[k] = v
    return out


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    _versions: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    namespaces: tuple[str, ...] = ("default",)
    requests: collections.Counter[tuple[str, bool]] = attrs.field(
        factory=collections.Counter, init=False
    )
    by_agent: collections.Counter[tuple[str, str, bool]] = attrs.field(
        factory=collections.Counter, init=False
    )
    by_method_resource: collections.Counter[tuple[str, str]] = attrs.field(
        factory=collections.Counter, init=False
    )
    versioned: frozenset[str] = frozenset({"endpointslices"})
    histories: dict[str, History] = attrs.field(factory=dict, init=False)
    outage: int = 0
    rv: int = attrs.field(default=999, init=False)
    _inflight: set[Any] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _Buses(self)

    def next_rv(self) -> int:
        self.rv = next(self._versions)
        return self.rv

    def history(self, plural: str) -> History:
        return self.histories.setdefault(plural, History())

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        watch = raw_request.query.get("watch") == "true"
        self.requests[(raw_request.method, watch)] += 1
        agent = raw_request.headers.get("User-Agent", "").split("/")[0]
        self.by_agent[(agent, raw_request.method, watch)] += 1
        self.by_method_resource[(raw_request.method, _plural(raw_request.path))] += 1
        if self.outage:
            status = {"kind": "Status", "code": self.outage, "message": "emulated outage"}
            return aiohttp.web.json_response(status, status=self.outage)
        if raw_request.method == "GET" and raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_namespaces(raw_request)
        self._inflight.add(id(raw_request))
        try:
            return await super().__call__(raw_request)
        finally:
            self._inflight.discard(id(raw_request))
            self._forget_served()

    def _forget_served(self) -> None:
        """kmock keeps every request it served and, for each new one, scans them all to find
        it again (``request in payload._source``): quadratic, minutes per request after
        some 10,000 requests (bench/operator_load.py's 100 objects never finished). Forget
        the served ones; requests still in flight (open watches) stay."""
        if len(self._requests) < len(self._inflight) + 32:
            return

        def live(requests: list[Any]) -> list[Any]:
            return [r for r in requests if id(r._raw_request) in self._inflight]

        self._requests[:] = live(self._requests)
        for payload in self._payloads:
            payload._requests[:] = live(payload._requests)

    async def _serve_namespaces(
        self, raw_request: aiohttp.web.BaseRequest
    ) -> aiohttp.web.StreamResponse:
        items = [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": ns, "uid": ns, "resourceVersion": "1"},
            }
            for ns in self.namespaces
        ]
        if raw_request.query.get("watch") != "true":
            return aiohttp.web.json_response(
                {"kind": "NamespaceList", "metadata": {"resourceVersion": "1"}, "items": items}
            )
        resp = aiohttp.web.StreamResponse()
        await resp.prepare(raw_request)
        for item in items:
            await resp.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        while raw_request.transport is not None and not raw_request.transport.is_closing():
            await asyncio.sleep(0.2)  # namespaces never change here; end when the client leaves
        return resp

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.name and _is_apply(request):
            response = self._server_side_apply(request)
            if response is not None:
                return response
        if request.resource is not None and request.action == kmock.action.CREATE:
            _validate(request.data)
            self._on_create(request.data)
        elif (
            request.resource is not None and request.action == kmock.action.UPDATE and request.name
        ):
            # kmock matches reactions by request identity: replace the data in place.
            object.__setattr__(request, "data", self._on_patch(request))
        response = await super()._handle(request)
        if request.subresource == "scale" and request.name:
            return aiohttp.web.json_response(self._scale_of(request))
        return response

    def _scale_of(self, request: kmock.Request) -> dict[str, Any]:
        """The autoscaling/v1 Scale a ``/scale`` request answers (of the object it changed)."""
        key: Any = (request.resource, request.namespace, request.name)
        obj = self.objects[key].raw
        meta = obj.get("metadata") or {}
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {k: meta.get(k) for k in ("name", "namespace", "resourceVersion")},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 1)},
            "status": {"replicas": (obj.get("status") or {}).get("replicas", 0)},
        }

    def _on_create(self, data: dict[str, Any]) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(self.next_rv())
        meta["generation"] = 1
        now = datetime.datetime.now(datetime.UTC)
        meta["creationTimestamp"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _server_side_apply(self, request: kmock.Request) -> Any:
        """A PATCH of type ``application/apply-patch+yaml``: creates a missing object, merges
        into an existing one (approximately: fields another manager owns are not tracked),
        and with ``dryRun=All`` answers the result without storing it. Returns a response
        for dry runs; otherwise turns the request into the CREATE or merge PATCH it amounts to."""
        if not request.params.get("fieldManager"):
            message = "PatchOptions.meta.k8s.io is invalid: fieldManager is required for apply"
            raise kmock.KubernetesError(status=422, reason="Invalid", message=message)
        key: Any = (request.resource, request.namespace, request.name)
        exists = key in self.objects and not self.objects[key].deleted
        current = dict(self.objects[key].raw) if exists else None
        if current is None:
            data = copy.deepcopy(request.data)
            data.setdefault("metadata", {}).setdefault("name", request.name)
            if request.params.get("dryRun") == "All":
                self._on_create(data)
                return aiohttp.web.json_response(data, status=201)
            object.__setattr__(request, "action", kmock.action.CREATE)
            object.__setattr__(request, "data", data)
            return None
        merged = _patched(current, request.data)
        if request.params.get("dryRun") == "All":
            return aiohttp.web.json_response(merged)
        object.__setattr__(request, "data", merge_diff(current, merged))
        return None

    def _has_status_subresource(self, resource: Any) -> bool:
        # Without a status subresource (kopf's peering CRDs) status is part of the object.
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _on_patch(self, request: kmock.Request) -> dict[str, Any]:
        key: Any = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        current = dict(self.objects[key].raw)
        data = request.data
        if isinstance(data, list):  # application/json-patch+json
            try:
                data = merge_diff(current, jsonpatch.apply_patch(current, data))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
        if not isinstance(data, dict):
            raise kmock.KubernetesError(
                status=400, reason="BadRequest", message="patch must be an object"
            )
        if request.subresource == "status":
            data = {"status": data.get("status")} if "status" in data else {}
        elif request.subresource == "scale":  # a Scale: only spec.replicas reaches the object
            replicas = (data.get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                message = f"Scale.spec.replicas: Invalid value: {replicas!r}"
                raise kmock.KubernetesError(status=422, reason="Invalid", message=message)
            data = {"spec": {"replicas": replicas}}
        elif self._has_status_subresource(request.resource):
            data = {k: v for k, v in data.items() if k != "status"}
        meta = data.setdefault("metadata", {}) or {}
        data["metadata"] = meta
        meta["resourceVersion"] = str(self.next_rv())
        if "spec" in data and merge_diff(
            current.get("spec") or {}, _patched(current.get("spec"), data["spec"])
        ):
            meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        return data

    # -- resourceVersion semantics for ``versioned`` kinds (k8s_history.py) ----------------
    def _is_versioned(self, request: kmock.Request) -> bool:
        return request.resource is not None and request.resource.plural in self.versioned

    def _current(self, request: kmock.Request) -> list[dict[str, Any]]:
        selector = request.params.get("labelSelector", "")
        return [
            o.raw
            for (res, _ns, _n), o in self._objects.items()
            if res == request.resource
            and not o.deleted
            and matches(o.raw, request.namespace, selector)
        ]

    async def _serve_list(self, request: kmock.Request) -> Any:
        if not self._is_versioned(request):
            return await super()._serve_list(request)
        async with self._lock:  # objects and history change together under this lock
            items = self._current(request)
            assert request.resource and request.resource.plural  # _is_versioned: a known one
            rv = self.history(request.resource.plural).last
        return {"metadata": {"resourceVersion": str(rv)}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> Any:
        if not self._is_versioned(request):
            async for item in super()._serve_watch(request):
                yield item
            return
        assert request.resource and request.resource.plural  # _is_versioned: a known one
        history = self.history(request.resource.plural)
        params = request.params
        since = params.get("resourceVersion", "")
        timeout_s = float(params.get("timeoutSeconds") or 3600)
        if not since.isdigit() or since == "0":  # "any version": the current state first
            yield b""
            async with self._lock:
                items, since = self._current(request), str(history.last)
            for item in items:
                yield {"type": "ADDED", "object": item}
        stream = watch_from(
            history, int(since), request.namespace, params.get("labelSelector", ""), timeout_s
        )
        async for item in stream:
            yield item


class _Buses(dict[Any, Any]):
    """kmock's per-resource event buses; for ``versioned`` kinds, the watch history instead."""

    def __init__(self, server: ApiServer) -> None:
        super().__init__()
        self.server = server

    def __missing__(self, resource: Any) -> Any:
        if resource.plural in self.server.versioned:
            bus: Any = _Recorder(self.server, self.server.history(resource.plural))
        else:
            bus = kmock.Bus()
        self[resource] = bus
        return bus


class _Recorder:
    def __init__(self, server: ApiServer, history: History) -> None:
        self.server, self.history = server, history

    async def put(self, event: dict[str, Any]) -> None:
        if event["type"] == "DELETED":  # a deletion is a new version, as in etcd
            obj = copy.deepcopy(event["object"])
            obj.setdefault("metadata", {})["resourceVersion"] = str(self.server.next_rv())
            event = {"type": "DELETED", "object": obj}
        await self.history.put(rv_of(event["object"]), event)


def _is_apply(request: kmock.Request) -> bool:
    ctype = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
    return request.method == "PATCH" and ctype.startswith("application/apply-patch")


def _patched(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return patch
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _patched(base.get(k), v)
    return out


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _validate(obj: Any) -> None:
    """The API server's own validation of a built-in kind (one rule, enough to get a 422)."""
    if not isinstance(obj, dict) or obj.get("kind") != "Deployment":
        return
    selector = obj.get("spec", {}).get("template", {}).get("spec", {}).get("nodeSelector") or {}
    for value in selector.values():
        if not _LABEL_VALUE.match(str(value)) or len(str(value)) > 63:
            name = obj.get("metadata", {}).get("name")
            message = (
                f'Deployment.apps "{name}" is invalid: spec.template.spec.nodeSelector: '
                f'Invalid value: "{value}": a valid label must be an empty string or consist '
                "of alphanumeric characters, '-', '_' or '.'"
            )
            raise kmock.KubernetesError(status=422, reason="Invalid", message=message)


def _plural(path: str) -> str:
    """The resource of an API path: ``/api/v1/namespaces/ns/secrets/x`` -> ``secrets``."""
    parts = [p for p in path.split("/") if p]
    if "namespaces" in parts:
        i = parts.index("namespaces")
        parts = parts[i + 2 :] if len(parts) > i + 2 else parts[i : i + 1]
    else:
        parts = parts[2:] if parts[:1] == ["api"] else parts[3:]
    return parts[0] if parts else ""
