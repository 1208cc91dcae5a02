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
- ``GET /api/v1/namespaces`` (list and watch), which kmock 0.8 cannot parse;
- one built-in validation, as an example of what only the API server knows: a Deployment
  whose ``nodeSelector`` holds an invalid label value is refused with a 422 and the
  API server's message;
- a count of requests by (method, watch?) in ``requests`` and by (User-Agent product,
  method, watch?) in ``by_agent`` (bench/operator_load.py counts the operator's).
Still missing (the tests account for it): garbage collection, CRD schema validation.
"""

from __future__ import annotations

import asyncio
import collections
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

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        watch = raw_request.query.get("watch") == "true"
        self.requests[(raw_request.method, watch)] += 1
        agent = raw_request.headers.get("User-Agent", "").split("/")[0]
        self.by_agent[(agent, raw_request.method, watch)] += 1
        if raw_request.method == "GET" and raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_namespaces(raw_request)
        return await super().__call__(raw_request)

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
        if request.resource is not None and request.action == kmock.action.CREATE:
            _validate(request.data)
            self._on_create(request.data)
        elif (
            request.resource is not None and request.action == kmock.action.UPDATE and request.name
        ):
            # kmock matches reactions by request identity: replace the data in place.
            object.__setattr__(request, "data", self._on_patch(request))
        return await super()._handle(request)

    def _on_create(self, data: dict[str, Any]) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        now = datetime.datetime.now(datetime.timezone.utc)
        meta["creationTimestamp"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _has_status_subresource(self, resource: Any) -> bool:
        # Without a status subresource (kopf's peering CRDs) status is part of the object.
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _on_patch(self, request: kmock.Request) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
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
        elif self._has_status_subresource(request.resource):
            data = {k: v for k, v in data.items() if k != "status"}
        meta = data.setdefault("metadata", {}) or {}
        data["metadata"] = meta
        meta["resourceVersion"] = str(next(self._versions))
        if "spec" in data and merge_diff(
            current.get("spec") or {}, _patched(current.get("spec"), data["spec"])
        ):
            meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        return data


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
