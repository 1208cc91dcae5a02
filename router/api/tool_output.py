"""Tool calling, response side: the model's text → OpenAI ``tool_calls``, whole or streamed.

Streaming sends each call's name first (with its id and index), then its arguments
in fragments as they are generated, as OpenAI does. The three shapes of reply
(router/api/tools.py): a named function's arguments object; ``required``'s JSON array
``[{"name": ..., "arguments": {...}}, ...]``, scanned incrementally; ``auto``'s
``<tool_call>{...}</tool_call>`` blocks, held back from the stream once the reply
starts like one and parsed at the end (text that does not is streamed as content).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pdserve.router.api.tools import ToolConfig

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _name_delta(index: int, name: str) -> dict[str, Any]:
    return {
        "tool_calls": [
            {
                "index": index,
                "id": _call_id(),
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
        ]
    }


def _args_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": args}}


class ArrayScanner:
    """Incremental scan of ``[{"name": "f", "arguments": {...}}, ...]``: yields
    ("name", name) once a call's name is complete and ("args", text) fragments."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = self.esc = False
        self.buf: list[str] | None = None  # a string being read inside a call object
        self.key: str | None = None
        self.expect_key = True
        self.args = False  # inside an arguments value

    def feed(self, text: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        for ch in text:
            if self.args:
                self._track(ch)
                self.args = self.depth > 2  # false once the arguments object closed
                events.append(("args", ch))
            else:
                self._outside_args(ch, events)
        merged: list[tuple[str, str]] = []  # one fragment per run of argument text
        for kind, value in events:
            if merged and kind == "args" and merged[-1][0] == "args":
                merged[-1] = ("args", merged[-1][1] + value)
            else:
                merged.append((kind, value))
        return merged

    def _track(self, ch: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _outside_args(self, ch: str, events: list[tuple[str, str]]) -> None:
        if self.buf is not None:  # reading a key or the name, inside a call object
            if self.esc or ch == "\\":
                self.esc = not self.esc
                self.buf.append(ch)
            elif ch != '"':
                self.buf.append(ch)
            else:
                self._string_done(json.loads('"' + "".join(self.buf) + '"'), events)
            return
        if self.depth == 2 and ch == '"':
            self.buf = []
        elif self.depth == 2 and ch == ":":
            self.expect_key = False
        elif self.depth == 2 and ch == ",":
            self.expect_key = True
        elif self.depth == 2 and ch == "{" and self.key == "arguments" and not self.expect_key:
            self.args = True
            self.depth += 1
            events.append(("args", ch))
        else:
            self._track(ch)
            if self.depth == 2 and ch == "{":  # a new call object
                self.expect_key, self.key = True, None

    def _string_done(self, text: str, events: list[tuple[str, str]]) -> None:
        self.buf = None
        if self.expect_key:
            self.key = text
        elif self.key == "name":
            events.append(("name", text))


class ToolOutput:
    """Per chat request with tools: ``feed`` each text delta, ``finish`` at the end, or
    ``message`` for a whole reply. Deltas are OpenAI chat ``delta`` objects."""

    def __init__(self, cfg: ToolConfig) -> None:
        self.cfg = cfg
        self.index = -1  # of the call being streamed
        self.scanner = ArrayScanner()
        self.held = ""  # auto: text that may still turn out to be a call
        self.mode = "undecided" if cfg.choice == "auto" else cfg.choice

    # -- whole replies ---------------------------------------------------------
    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        calls, content = self._parse(text, finish)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return msg, ("tool_calls" if calls and finish == "stop" else finish)

    def _parse(self, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        if self.cfg.choice == "named":
            if finish != "stop":  # cut short: not a complete call
                return [], text
            return [_call(self.cfg.named or "", text)], None
        if self.cfg.choice == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return [], text
            return [_call(c["name"], c["arguments"]) for c in items], None
        calls = []
        for block in BLOCK.findall(text):
            try:
                item = json.loads(block)
            except ValueError:
                continue
            if isinstance(item, dict) and self.cfg.function(str(item.get("name"))):
                calls.append(_call(item["name"], item.get("arguments", {})))
        if not calls:
            return [], text
        rest = BLOCK.sub("", text).strip()
        return calls, rest or None

    # -- streams ---------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.mode == "named":
            out = []
            if self.index < 0:
                self.index = 0
                out.append(_name_delta(0, self.cfg.named or ""))
            return [*out, _args_delta(0, text)]
        if self.mode == "required":
            return self._scan(text)
        if self.mode == "text":
            return [{"content": text}]
        self.held += text
        head = self.held.lstrip()
        if head.startswith(OPEN):
            self.mode = "calls"
        elif not OPEN.startswith(head):
            self.mode, held, self.held = "text", self.held, ""
            return [{"content": held}]
        return []

    def _scan(self, text: str) -> list[dict[str, Any]]:
        out = []
        for kind, value in self.scanner.feed(text):
            if kind == "name":
                self.index += 1
                out.append(_name_delta(self.index, value))
            elif self.index >= 0:
                out.append(_args_delta(self.index, value))
        return out

    def finish(self, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Deltas still held back, and the finish reason to report."""
        if self.mode in ("named", "required"):
            called = self.index >= 0 and finish == "stop"
            return [], ("tool_calls" if called else finish)
        if self.mode == "text":
            return [], finish
        calls, content = self._parse(self.held, finish)
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for i, call in enumerate(calls):
            fn = call["function"]
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
            out.append(_args_delta(i, fn["arguments"]))
        return out, ("tool_calls" if calls and finish == "stop" else finish)
