"""The endpoint-picker protocol's words, in Envoy ext_proc messages.

What the Gateway API Inference Extension's endpoint-picker protocol defines
(docs/router.md, "Endpoint picker mode", names the version followed):

- the picked endpoints go out twice, equal: the ``x-gateway-destination-endpoint``
  request header and the ``envoy.lb`` dynamic-metadata namespace's key of the same name,
  as ``ip:port[,ip:port...]`` (the first is the primary, the rest the fallbacks a retry
  walks in order);
- the proxy may restrict the pick to a subset: filter metadata
  ``envoy.lb.subset_hint`` → ``x-gateway-destination-endpoint-subset`` (a list of
  ``ip:port``); none of it eligible → 503;
- on the response, the proxy tells which endpoint served: ``envoy.lb`` →
  ``x-gateway-destination-endpoint-served``;
- no endpoint → an ImmediateResponse 503; a request to shed → 429.

This module only builds and reads messages: no state, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Lower-cased name → value (Envoy sends ``raw_value``; older ones ``value``)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out[h.key.lower()] = value
    return out


def _field(msg: ep.ProcessingRequest, namespace: str, key: str) -> Any:
    md = msg.metadata_context.filter_metadata
    if namespace not in md or key not in md[namespace].fields:
        return None
    value = md[namespace].fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    return value.string_value if kind == "string_value" else None


def subset_hint(msg: ep.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the proxy allows (None: no hint, every pool endpoint)."""
    value = _field(msg, SUBSET_NAMESPACE, SUBSET)
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).split(",")
    return frozenset(s.strip() for s in items if s.strip())


def served_endpoint(msg: ep.ProcessingRequest) -> str:
    """The endpoint that answered ("" when the proxy did not say)."""
    value = _field(msg, LB_NAMESPACE, SERVED)
    return value if isinstance(value, str) else ""


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def routed(
    endpoints: Sequence[str], set_headers: Mapping[str, str], remove: Iterable[str]
) -> tuple[ep.CommonResponse, struct_pb2.Struct]:
    """The request's mutation and metadata: destination (header and metadata, equal),
    the extra headers, the route cache cleared (the destination changes the route)."""
    assert endpoints, "a routed answer names at least one endpoint"
    value = ",".join(endpoints)
    mutation = ep.HeaderMutation(
        set_headers=[_header(DESTINATION, value)] + [_header(k, v) for k, v in set_headers.items()],
        remove_headers=list(remove),
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: value}})
    return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True), metadata


def _with_metadata(
    resp: ep.ProcessingResponse, metadata: struct_pb2.Struct | None
) -> ep.ProcessingResponse:
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def headers_response(
    common: ep.CommonResponse | None = None, metadata: struct_pb2.Struct | None = None
) -> ep.ProcessingResponse:
    headers = ep.HeadersResponse(response=common)
    return _with_metadata(ep.ProcessingResponse(request_headers=headers), metadata)


def body_response(
    common: ep.CommonResponse | None = None, metadata: struct_pb2.Struct | None = None
) -> ep.ProcessingResponse:
    body = ep.BodyResponse(response=common)
    return _with_metadata(ep.ProcessingResponse(request_body=body), metadata)


def streamed_body(body: bytes, end: bool, response: bool = False) -> ep.ProcessingResponse:
    """A body chunk sent back in full-duplex mode (the proxy forwards only what we send)."""
    streamed = ep.StreamedBodyResponse(body=body, end_of_stream=end)
    mutation = ep.BodyMutation(streamed_response=streamed)
    common = ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
    if response:
        return ep.ProcessingResponse(response_body=common)
    return ep.ProcessingResponse(request_body=common)


def immediate(status: int, body: Mapping[str, Any], details: str = "") -> ep.ProcessingResponse:
    """The proxy answers the client itself: ``status`` and an OpenAI-style JSON body."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=ep.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=json.dumps(body).encode(),
            details=details[:200],
        )
    )
