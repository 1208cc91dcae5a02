"""OpenAI request bodies → one validated :class:`GenerateRequest`.

Every problem with client input raises :class:`APIError` 400 naming the field;
sampling parameters are checked by the engine's own ``SamplingParams.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import InvalidParameter, SamplingParams
from pdserve.router.errors import APIError, invalid
from pdserve.router.structured_request import structured_spec

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Accepted only at their "off" values: (field, values meaning off).
UNSUPPORTED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("echo", (None, False)),
    ("best_of", (None, 1)),
    ("suffix", (None, "")),
    ("tools", (None, [])),
)


@dataclass(frozen=True)
class GenerateRequest:
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


def parse_request(body: Any, chat: bool, default_max_tokens: int) -> GenerateRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model is required (a string)", "model")
    for name, off in UNSUPPORTED:
        if name in body and body[name] not in off:
            raise invalid(f"{name} is not supported by this server", name)
    n = body.get("n", 1)
    if n is not None and (type(n) is not int or n != 1):
        raise invalid(f"only n=1 is supported, got {n!r}", "n")
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
    )
    if chat:
        return GenerateRequest(chat=True, messages=parse_messages(body.get("messages")), **common)
    text, ids = _prompt(body.get("prompt"))
    return GenerateRequest(chat=False, prompt_text=text, prompt_token_ids=ids, **common)


MAX_CACHE_SALT_CHARS = 256


def _cache_salt(salt: Any) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise invalid(f"cache_salt must be a non-empty string of at most "
                      f"{MAX_CACHE_SALT_CHARS} characters", "cache_salt")  # fmt: skip
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


def _sampling(body: dict[str, Any], max_tokens: int, chat: bool) -> SamplingParams:
    def get(name: str, default: Any) -> Any:
        value = body.get(name)
        return default if value is None else value

    stop = get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=get("temperature", 1.0),
            top_p=get("top_p", 1.0),
            top_k=get("top_k", 0),
            seed=body.get("seed"),
            stop=stop,
            ignore_eos=get("ignore_eos", False),
            min_tokens=get("min_tokens", 0),
            presence_penalty=get("presence_penalty", 0.0),
            frequency_penalty=get("frequency_penalty", 0.0),
            repetition_penalty=get("repetition_penalty", 1.0),
            min_p=get("min_p", 0.0),
            logit_bias=_logit_bias(get("logit_bias", {})),
            logprobs=_logprobs(body, chat),
            structured=structured_spec(body),
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
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    if not isinstance(bias, dict):
        raise invalid("logit_bias must map token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit()) and not isinstance(key, int):
            raise invalid(f"logit_bias key {key!r} is not a token id", "logit_bias")
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
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
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
        out.append({"role": role, "content": _content(m.get("content"), i)})
    return tuple(out)


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
            404, f"model {requested!r} does not exist; served: {list(served)}", "model",
            "model_not_found",
        )  # fmt: skip
