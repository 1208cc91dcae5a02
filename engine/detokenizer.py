"""Incremental detokenization and stop strings, per request, in O(new tokens) a step.

``IncrementalDetokenizer`` turns a stream of token ids into a stream of text
deltas that never splits a multi-byte character. It decodes only a short window
(prefix/read offsets): the tokens already emitted as text since the last
character boundary serve as context, so that decoders which depend on the
neighbours (leading-space stripping, byte fallback) give the same text as a
decode of the whole sequence::

    tokens:  ... | prefix_offset ........ read_offset ........ len(tokens)
                   [ already emitted ]    [ new, not yet emitted ]
    delta = decode(prefix..end)[len(decode(prefix..read)):]

If the window's text ends in U+FFFD the last character may be incomplete: the
text before it is sent and the U+FFFD run is held back until a later token
completes it (or ``flush`` at the end); the window moves on only once the text
ends on a character boundary.

``StopChecker`` scans the emitted text for stop strings. It holds back the
longest tail that could still grow into a stop string, so a stop string split
across tokens is never partly sent to the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context for the first output token.
PROMPT_CONTEXT_TOKENS = 5
# Bound on the decoded window when no token ends on a character boundary for
# this long (only garbage output does that); the offsets then move on anyway.
MAX_WINDOW_TOKENS = 64


class IncrementalDetokenizer:
    """Per-request detokenizer. ``append`` returns the newly completed text.

    To resume a request elsewhere (the decode worker after a prefill worker sent
    the first token's text), build it with the prompt and ``append`` the tokens
    whose text was already sent one at a time, discarding the result
    (``TextStream.replay``): the state then matches.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_fn = _decoder_for(tokenizer, skip_special_tokens)
        # Only a short tail of the prompt is ever needed as context.
        self.tokens: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self._prefix_len = len(self._decode(0, self.read_offset))
        self._sent_in_window = 0  # chars after the prefix text already returned
        self.num_output_tokens = 0
        self.output_text = ""  # everything returned so far, including flush()

    def append(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they complete (maybe "")."""
        if not token_ids:
            return ""
        self.tokens.extend(token_ids)
        self.num_output_tokens += len(token_ids)
        window_text = self._decode(self.prefix_offset, len(self.tokens))
        # Characters before a trailing run of U+FFFD are final (UTF-8 resynchronises);
        # the run may be an incomplete character that later tokens finish.
        stable = window_text.rstrip(REPLACEMENT_CHAR)
        at_boundary = len(stable) == len(window_text)
        if not at_boundary and len(self.tokens) - self.read_offset > MAX_WINDOW_TOKENS:
            stable, at_boundary = window_text, True
        delta = stable[self._prefix_len + self._sent_in_window :]
        self._sent_in_window += len(delta)
        if at_boundary:
            self._move_window()
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: the held text, incomplete characters included."""
        window_text = self._decode(self.prefix_offset, len(self.tokens))
        delta = window_text[self._prefix_len + self._sent_in_window :]
        self._sent_in_window += len(delta)
        self.output_text += delta
        return delta

    def _move_window(self) -> None:
        """All tokens are decoded and the text ends on a character boundary."""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self._prefix_len = len(self._decode(self.prefix_offset, self.read_offset))
        self._sent_in_window = 0
        if self.prefix_offset > 64:  # tokens before prefix_offset are never decoded again
            del self.tokens[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode_fn(self.tokens[start:end])


def _decoder_for(tokenizer: Any, skip_special_tokens: bool) -> Any:
    """The fastest decode callable: the Rust tokenizer when there is one.

    Both paths skip ``clean_up_tokenization_spaces``: it rewrites text across
    token boundaries (" ." -> "."), which a stream cannot take back.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


@dataclass(frozen=True)
class StopResult:
    text: str  # safe to emit now
    stop: str | None = None  # the stop string that ended the output, if any

    @property
    def stopped(self) -> bool:
        return self.stop is not None


class StopChecker:
    """Per-request stop-string scanner over streamed text.

    ``feed(delta)`` is called with each detokenizer delta and returns the text
    that may be sent; after a stop string is found it returns the text before it
    and ``stop`` set, and the request must end. ``flush()`` returns the held
    tail when the request ends for another reason (length, EOS).
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.stop = list(dict.fromkeys(stop))
        self.max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._first_chars = {s[0] for s in self.stop}
        self._pending = ""  # text held back: could be the start of a stop string
        self.stopped: str | None = None

    def feed(self, delta: str) -> StopResult:
        assert self.stopped is None, "feed() after a stop string ended the output"
        if not self.stop:
            return StopResult(delta)
        buf = self._pending + delta
        hit = self._earliest(buf)
        if hit is not None:
            index, stop = hit
            self._pending = ""
            self.stopped = stop
            return StopResult(buf[:index], stop)
        hold = self._hold_length(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return StopResult(buf[: len(buf) - hold])

    def flush(self) -> str:
        pending, self._pending = self._pending, ""
        return pending

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            index = buf.find(s)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, s)
        return best

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        for i in range(max(0, len(buf) - self.max_hold), len(buf)):
            if buf[i] in self._first_chars:
                tail = buf[i:]
                if any(s.startswith(tail) for s in self.stop):
                    return len(buf) - i
        return 0


@dataclass(frozen=True)
class TextDelta:
    text: str
    stop: str | None = None  # set when a stop string ended the output


class TextStream:
    """Detokenizer and stop checker composed: what the engine keeps per request."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stop_checker = StopChecker(stop)
        self.text = ""  # all text emitted so far (stop string excluded)

    def replay(self, token_ids: Sequence[int]) -> None:
        """Catch up with tokens whose text was sent already (the first token from the
        prefill worker, a migrated stream's), as the worker that sent them did: one at a
        time, so the window holds back what it held there. At once, a replay longer than
        MAX_WINDOW_TOKENS that ends inside a character counted the held-back U+FFFD as
        sent, and the new worker never sent it."""
        for token_id in token_ids:
            self.append([token_id])

    def append(self, token_ids: Sequence[int]) -> TextDelta:
        result = self.stop_checker.feed(self.detokenizer.append(token_ids))
        self.text += result.text
        return TextDelta(result.text, result.stop)

    def finish(self) -> TextDelta:
        """The request ended (length, EOS, abort): release everything held back."""
        if self.stop_checker.stopped is not None:
            return TextDelta("", self.stop_checker.stopped)
        result = self.stop_checker.feed(self.detokenizer.flush())
        text = result.text if result.stopped else result.text + self.stop_checker.flush()
        self.text += text
        return TextDelta(text, result.stop)
