"""The model's tokenizer on the router side: prompts and chat messages to token ids.

The router tokenizes so that it can hash the prompt's blocks with the same
function as the workers; the ids it sends are the ids the workers compute on.

It runs on the router's tokenizer threads (``serving.prepare``). That helps only
because transformers' ``encode`` goes through the Rust ``encode_batch``, which
releases the GIL; the backend's own ``encode`` holds it for the whole text (2.3 s
for 560 k characters here, every stream of the router stalled meanwhile), so do
not call ``backend_tokenizer.encode`` here. tests/router/test_edge_limits.py
measures the streams' gaps while a large prompt is tokenized.

``PromptTokenizer.encode`` calls the Rust ``encode_batch_fast`` itself where transformers'
``encode`` would do no more than call ``encode_batch`` (its generic backend's own methods,
no truncation or padding set, special tokens not split): the same ids without ~25 µs of
transformers' wrapper per prompt (argument checks, a ``BatchEncoding``), which the P/D path
with text prompts paid on every request (issue 47). ``tests/router/test_tokenizer_fast.py``
compares both on every family's tokenizer.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

from pdserve.engine import model_seal
from pdserve.router.api.chat_options import ChatTemplateOptions
from pdserve.router.api.chat_render import encode_rendered, refuse_elsewhere, special_strings
from pdserve.router.errors import invalid

# How long a router waits for the workers' seal of a model in a shared cache (the pod's
# startup probe allows 30 minutes: operator/render_pods.py).
SEAL_WAIT_S = 25 * 60.0
# What tokenizer_config.json names when a model's tokenizer is the tokenizers library's
# own: transformers' generic backend (the two names are one class in transformers 5).
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Model types for which AutoTokenizer keeps such a declared generic class: not in
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (qwen2 and phi3 are, and get their
# own classes) and not mapped to MistralCommonBackend. Reading those tables imports
# transformers' configuration code and torch with it (~2 CPU-s and ~250 MB in every router
# process), so the list is kept here, and tests/router/test_tokenizer_load.py checks it
# against the installed transformers and compares both loads on every family's model.
DIRECT_MODEL_TYPES = frozenset(
    {
        "bloom",
        "deepseek_v2",
        "deepseek_v3",
        "falcon",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gpt_neox",
        "gpt_oss",
        "granite",
        "llama",
        "llama4_text",
        "olmo2",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "starcoder2",
    }
)
# The transformers releases (major, minor) the list was checked against: another release may
# have moved a type into those tables (5.17's differ), so it goes through AutoTokenizer until
# the test passes on it and the range is widened.
CHECKED_TRANSFORMERS = ((5, 24), (5, 25))


@cache
def direct_load_checked(installed: str | None = None) -> bool:
    """Whether the installed transformers (or ``installed``) is one the list was checked on."""
    parts = (installed or version("transformers")).split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return CHECKED_TRANSFORMERS[0] <= release <= CHECKED_TRANSFORMERS[-1]


def load_tokenizer(path: Path) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(path)`` returns. Where that is the
    generic backend by the rules above, it is loaded directly, which imports no torch;
    anything else (a model-specific class, remote code, another model type, a transformers
    release the rules were not checked on) goes through AutoTokenizer."""
    declared = _json(path / "tokenizer_config.json")
    if (
        direct_load_checked()
        and declared.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in declared
        and _json(path / "config.json").get("model_type") in DIRECT_MODEL_TYPES
    ):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _fast_encoder(tok: Any) -> Any:
    """The backend's ``encode_batch_fast`` (ids without offsets; it releases the GIL as
    ``encode_batch`` does) when ``tok.encode`` is transformers' generic path to
    ``encode_batch`` (not overridden by a model's class); else None."""
    try:
        from transformers import TokenizersBackend
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tok)
    generic = (
        isinstance(tok, TokenizersBackend)
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls.encode is PreTrainedTokenizerBase.encode
        and cls._get_padding_truncation_strategies
        is PreTrainedTokenizerBase._get_padding_truncation_strategies
    )
    backend = getattr(tok, "backend_tokenizer", None)
    return getattr(backend, "encode_batch_fast", None) if generic else None


class PromptTokenizer:
    def __init__(self, model_dir: str, seal_wait_s: float = SEAL_WAIT_S) -> None:
        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {model_dir!r} does not exist")
        # A shared cache: the tokenizer, chat template and config as the service's workers
        # sealed them, read once and loaded from a private copy (engine/model_seal.py).
        sealed = model_seal.load(model_dir, weights=model_seal.SKIP, wait_s=seal_wait_s)
        path = sealed.files if sealed is not None else path
        self.tok = load_tokenizer(path)
        self.vocab_size = len(self.tok)
        self.config_max_len = _config_max_len(path)
        self.specials = special_strings(self.tok)

        self._fast = _fast_encoder(self.tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tok.encode(text)``'s ids; straight from the Rust backend where that is all it
        does (``_fast_encoder``), checked per call (the backend's settings are mutable)."""
        fast = self._fast
        if fast is not None and self.fast_ready():
            return fast([text], add_special_tokens=add_special_tokens)[0].ids  # type: ignore[no-any-return]
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def fast_ready(self) -> bool:
        """Whether ``encode`` is the backend's ``encode_batch_fast`` alone right now (the
        backend's settings are mutable: checked per call)."""
        if self._fast is None:
            return False
        backend = self.tok.backend_tokenizer
        return (
            backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == bool(self.tok.split_special_tokens)
        )

    def backend_json(self) -> str | None:
        """The backend tokenizer as it is now (``to_str()``: what transformers made of the
        model's files), for the compiled lane to load (rust/router_lane/src/tokenize.rs);
        None where ``encode`` is not the backend's alone."""
        return self.tok.backend_tokenizer.to_str() if self.fast_ready() else None  # type: ignore[no-any-return]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        options: ChatTemplateOptions | None = None,
    ) -> list[int]:
        """The messages rendered by the model's chat template, as token ids; ``options``
        (the request's chat-template fields) override ``add_generation_prompt``."""
        if not getattr(self.tok, "chat_template", None):
            raise invalid("this model has no chat template; use /v1/completions", "messages")
        if options is None:
            options = ChatTemplateOptions(add_generation_prompt)
        refuse_elsewhere(messages, tools, options.kwargs, self.specials)

        def render(shown: list[dict[str, Any]]) -> str:
            try:
                text = self.tok.apply_chat_template(
                    shown,
                    add_generation_prompt=options.add_generation_prompt,
                    continue_final_message=options.continue_final_message,
                    tokenize=False,
                    tools=tools,  # type: ignore[arg-type]
                    **options.kwargs,
                )
            except Exception as exc:  # template errors (e.g. role order) are the client's
                raise invalid(f"messages could not be formatted: {exc}", "messages") from exc
            assert isinstance(text, str)
            return text

        def plain(text: str) -> list[int]:
            return self.encode(text, add_special_tokens=False)

        # control tokens only from the template, never from client text (router/api/chat_render.py)
        return encode_rendered(self.tok, messages, render, plain, self.specials)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _config_max_len(path: Path) -> int:
    value = _json(path / "config.json").get("max_position_embeddings") or 0
    return int(value) if isinstance(value, int) else 0
