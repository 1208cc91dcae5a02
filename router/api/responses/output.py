"""The Responses API's reply: the ``response`` object and its stream of typed events.

Both are built from what the chat path produces: a whole chat message (text and
``tool_calls``, router/api/tool_output.py) becomes the ``output`` items; a stream's chat deltas
(``{"content"}``, a call's name, its argument fragments) become the events, each item
opened, filled and closed in order::

    response.created, response.in_progress
    ┌ response.output_item.added (message)    ┌ response.output_item.added (function_call)
    │ response.content_part.added             │ response.function_call_arguments.delta ...
    │ response.output_text.delta ...          │ response.function_call_arguments.done
    │ response.output_text.done               └ response.output_item.done
    │ response.content_part.done
    └ response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it short)
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat message as Responses output items: its text, then its calls."""
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or ""))
    for c in calls:
        fn = c["function"]
        items.append(call_item(c["id"], fn["name"], fn["arguments"]))
    return items


class Shape:
    """The request's settings echoed in every ``response`` object."""

    def __init__(self, rid: str, body: dict[str, Any]) -> None:
        self.rid, self.created = rid, int(time.time())
        self.body = body

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        use: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": b.get("model"),
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": b.get("temperature", 1.0),
            "text": {"format": fmt},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": use,
            "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }


def status_of(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


class Events:
    """One streamed response: chat deltas in, SSE event text out."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # closed items, in order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.buf: list[str] = []  # its text or arguments so far

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {_ENCODER.encode(body)}\n\n"

    def start(self) -> str:
        r = self.shape.response("in_progress", [])
        return self.event("response.created", response=r) + self.event(
            "response.in_progress", response=r
        )

    def delta(self, d: dict[str, Any]) -> str:
        """One chat delta: ``{"content": text}`` or ``{"tool_calls": [...]}``."""
        out = ""
        if d.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._close() + self._open(message_item("", "in_progress"))
            self.buf.append(d["content"])
            out += self.event(
                "response.output_text.delta", **self._where(), delta=d["content"], logprobs=[]
            )
        for call in d.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:  # a new call: its name
                item = call_item(call["id"], fn.get("name", ""), "", "in_progress")
                out += self._close() + self._open(item)
            if fn.get("arguments"):
                self.buf.append(fn["arguments"])
                out += self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.open["id"] if self.open else "",
                    output_index=len(self.items),
                    delta=fn["arguments"],
                )
        return out

    def finish(self, finish: str | None, use: dict[str, Any]) -> str:
        out = self._close()
        if not self.items:  # nothing generated: one empty message, as a whole reply has
            out += self._open(message_item("", "in_progress")) + self._close()
        status = status_of(finish)
        r = self.shape.response(status, self.items, use)
        return out + self.event(f"response.{status}", response=r)

    def error(self, body: dict[str, Any]) -> str:
        err = body.get("error") or {}
        return self.event(
            "error", code=err.get("code"), message=err.get("message"), param=err.get("param")
        )

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}

    def _open(self, item: dict[str, Any]) -> str:
        self.open, self.buf = item, []
        out = self.event("response.output_item.added", output_index=len(self.items), item=item)
        if item["type"] == "message":
            out += self.event("response.content_part.added", **self._where(), part=_text_part(""))
        return out

    def _close(self) -> str:
        item = self.open
        if item is None:
            return ""
        text, index = "".join(self.buf), len(self.items)
        if item["type"] == "message":
            where = self._where()
            out = self.event("response.output_text.done", **where, text=text, logprobs=[])
            out += self.event("response.content_part.done", **where, part=_text_part(text))
            item = {**item, "status": "completed", "content": [_text_part(text)]}
        else:
            out = self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=text,
            )
            item = {**item, "status": "completed", "arguments": text}
        out += self.event("response.output_item.done", output_index=index, item=item)
        self.items.append(item)
        self.open, self.buf = None, []
        return out
