"""OpenAI request bodies → one validated :class:`CompletionRequest`.

Every problem with client input raises :class:`APIError` 400 naming the field;
sampling parameters are checked by the engine's own ``SamplingParams.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pdserve.protocol.codec import all_ints
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams
from pdserve.router.api.chat_options import ChatTemplateOptions, parse_chat_options
from pdserve.router.api.echo import EchoSpec, parse_echo
from pdserve.router.api.fields import check_fields
from pdserve.router.api.structured_request import structured_spec
from pdserve.router.api.tools import ToolConfig, grammar_spec, parse_tools
from pdserve.router.errors import APIError, invalid

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted only at their "off" values: (field, values meaning off).
UNSUPPORTED: tuple[tuple[str, tuple[Any, ...]], ...] = (("suffix", (None, "")),)


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    model: str
    sampling: SamplingParams
    max_tokens_given: bool
    stream: bool = False
    include_usage: bool = False
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    user: str | None = None
    cache_salt: str | None = None  # the client's prefix-cache salt (vLLM's field)
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:N" in logprobs
    tools: ToolConfig | None = None  # chat: tools that may be called (router/api/tools.py)
    n: int = 1  # choices returned (router/api/choices.py)
    best_of: int = 1  # choices generated; the n with the highest logprob sum are returned
    hide_logprobs: bool = False  # logprobs computed for best_of only, not asked for
    template: ChatTemplateOptions | None = None  # chat: how the messages are rendered
    echo: EchoSpec | None = None  # completions: echo / prompt_logprobs (router/api/echo.py)


def parse_request(body: Any, chat: bool, default_max_tokens: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string)", "model")
    check_fields(body, chat)
    for name, off in UNSUPPORTED:
        if name in body and body[name] not in off:
            raise invalid(f"{name} is not supported by this server", name)
    n, best_of = _n(body)
    echo = None if chat else parse_echo(body, n, best_of)
    if echo is not None and echo.score_only:  # the workers generate one token, dropped
        body = {**body, "max_tokens": 1}
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user must be a string", "user")
    as_ids = body.get("return_tokens_as_token_ids", False)
    if not isinstance(as_ids, bool):
        raise invalid("return_tokens_as_token_ids must be a boolean", "return_tokens_as_token_ids")
    stream, include_usage = _stream_flags(body)
    max_tokens = _max_tokens(body, chat)
    sampling = _sampling(body, max_tokens if max_tokens is not None else default_max_tokens, chat)
    common: dict[str, Any] = dict(
        model=model,
        sampling=sampling,
        max_tokens_given=max_tokens is not None,
        stream=stream,
        include_usage=include_usage,
        user=user,
        cache_salt=_cache_salt(body.get("cache_salt")),
        tokens_as_ids=as_ids,
        n=n,
        best_of=best_of,
    )
    if chat:
        tools = parse_tools(body)
        common["sampling"] = _with_tools(sampling, tools)
        messages = parse_messages(body.get("messages"))
        template = parse_chat_options(body, messages)
        return CompletionRequest(
            chat=True, messages=messages, tools=tools, template=template, **common
        )
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise invalid(f"{name} is a chat completions parameter", name)
    text, ids = _prompt(body.get("prompt"))
    if echo is not None:
        k = echo.engine_k(sampling.logprobs)
        common.update(echo=echo, sampling=replace(sampling, prompt_logprobs=k))
    if best_of > n and sampling.logprobs is None:  # ranking needs each token's logprob
        common.update(sampling=replace(sampling, logprobs=0), hide_logprobs=True)
    return CompletionRequest(chat=False, prompt_text=text, prompt_token_ids=ids, **common)


MAX_N = 16


def _n(body: dict[str, Any]) -> tuple[int, int]:
    n = body.get("n")
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise invalid(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    best_of = body.get("best_of")
    best_of = n if best_of is None else best_of
    if isinstance(best_of, bool) or not isinstance(best_of, int) or not n <= best_of <= MAX_N:
        raise invalid(f"best_of must be an integer in [n, {MAX_N}], got {best_of!r}", "best_of")
    if best_of > n and body.get("stream"):
        raise invalid("best_of > n cannot be streamed", "best_of")
    return n, best_of


def _with_tools(sampling: SamplingParams, tools: ToolConfig | None) -> SamplingParams:
    """A required / named tool_choice constrains the reply to a valid call."""
    if tools is None:
        return sampling
    if sampling.logprobs is not None:
        raise invalid("logprobs cannot be combined with tools", "logprobs")
    spec = grammar_spec(tools)
    if spec is None:
        return sampling
    if sampling.structured is not None:
        raise invalid(
            f"tool_choice {tools.choice!r} cannot be combined with {sampling.structured['param']}",
            "tool_choice",
        )
    try:
        return replace(sampling, structured=spec).validate()
    except InvalidParameter as exc:
        raise invalid(str(exc), exc.field) from exc


MAX_CACHE_SALT_CHARS = 256


def _cache_salt(salt: Any) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            "cache_salt",
        )
    return salt


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("stream_options.include_usage must be a boolean", "stream_options")
    return stream, usage


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{name} must be an integer", name)
        if value < 1:
            raise invalid(f"{name} must be at least 1, got {value}", name)
        return value
    return None


# Sampling fields taken as sent, and their values when absent or null.
SAMPLING_DEFAULTS = (
    ("temperature", 1.0),
    ("top_p", 1.0),
    ("top_k", 0),
    ("ignore_eos", False),
    ("min_tokens", 0),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_p", 0.0),
)


def _sampling(body: dict[str, Any], max_tokens: int, chat: bool) -> SamplingParams:
    given: dict[str, Any] = {}
    for name, default in SAMPLING_DEFAULTS:  # inline: a call per field was ~1/5 of parsing
        value = body.get(name)
        given[name] = default if value is None else value
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    stop_ids, bias = body.get("stop_token_ids"), body.get("logit_bias")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=body.get("seed"),
            stop=stop,
            stop_token_ids=[] if stop_ids is None else stop_ids,
            logit_bias={} if bias is None else _logit_bias(bias),
            logprobs=_logprobs(body, chat),
            structured=structured_spec(body),
            **given,
        ).validate()
    except InvalidParameter as exc:
        raise invalid(str(exc), exc.field) from exc
    except TypeError as exc:  # e.g. an unhashable where a number belongs
        raise invalid(f"bad sampling parameter: {exc}") from exc


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The number of top logprobs per token, None when off (chat: logprobs + top_logprobs)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if value is None or value is False:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20:
            raise invalid("logprobs must be an integer in [0, 20]", "logprobs")
        if top is not None:
            raise invalid("top_logprobs is a chat parameter; use logprobs", "top_logprobs")
        return value
    if value is not None and not isinstance(value, bool):
        raise invalid("logprobs must be a boolean", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise invalid("top_logprobs must be an integer in [0, 20]", "top_logprobs")
        if not value:
            raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if value else None


def _logit_bias(bias: Any) -> Any:
    """OpenAI sends token ids as JSON object keys, i.e. strings: plain ASCII digits, at most
    10 of them. ``str.isdigit`` alone lets "²" or "٣" through, and ``int`` of 5,000 digits
    raises: both were 500s."""
    if not isinstance(bias, dict):
        raise invalid("logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        plain = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
        if not plain and not (isinstance(key, int) and not isinstance(key, bool)):
            shown = key if len(str(key)) <= 20 else str(key)[:20] + "..."
            raise invalid(f"logit_bias key {shown!r} is not a token id", "logit_bias")
        out[int(key)] = value
    return out


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("a batch of several prompts is not supported; send one per request", "prompt")
    if isinstance(prompt, list) and prompt:
        if not all_ints(prompt) or min(prompt) < 0:
            raise invalid("prompt token ids must be non-negative integers", "prompt")
        return None, tuple(prompt)
    raise invalid("prompt is required: a string or a list of token ids", "prompt")


def parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages is required: a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {list(CHAT_ROLES)}", "messages")
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), i)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"messages[{i}]: a tool message needs tool_call_id", "messages")
            msg["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return tuple(out)


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    def bad() -> APIError:
        return invalid(
            f"messages[{i}].tool_calls: each needs id and function {{name, arguments (a string)}}",
            "messages",
        )

    if not isinstance(calls, list):
        raise bad()
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad()
        if not isinstance(fn.get("arguments", ""), str) or not isinstance(c.get("id", ""), str):
            raise bad()
        function = {"name": fn["name"], "arguments": fn.get("arguments", "")}
        out.append({"id": c.get("id", ""), "type": "function", "function": function})
    return out


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise invalid(f"messages[{i}].content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise invalid(f"messages[{i}].content: a text part needs 'text'", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise invalid(f"messages[{i}].content must be a string or a list of parts", "messages")


def check_model(requested: str, served: tuple[str, ...]) -> None:
    if requested not in served:
        raise APIError(
            404,
            f"model {requested!r} does not exist; served: {list(served)}",
            "model",
            "model_not_found",
        )
