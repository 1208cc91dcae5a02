"""The model's tokenizer on the router side: prompts and chat messages to token ids.

The router tokenizes so that it can hash the prompt's blocks with the same
function as the workers; the ids it sends are the ids the workers compute on.

It runs on the router's tokenizer threads (``serving.prepare``). That helps only
because transformers' ``encode`` goes through the Rust ``encode_batch``, which
releases the GIL; the backend's own ``encode`` holds it for the whole text (2.3 s
for 560 k characters here, every stream of the router stalled meanwhile), so do
not call ``backend_tokenizer.encode`` here. tests/router/test_edge_limits.py
measures the streams' gaps while a large prompt is tokenized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.router.api.chat_options import ChatTemplateOptions
from pdserve.router.api.chat_render import encode_rendered, refuse_elsewhere, special_strings
from pdserve.router.api.errors import invalid


class PromptTokenizer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        path = Path(model_dir)
        if not path.is_dir():
            raise ValueError(f"model directory {model_dir!r} does not exist")
        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.vocab_size = len(self.tok)
        self.config_max_len = _config_max_len(path)
        self.specials = special_strings(self.tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

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


def _config_max_len(path: Path) -> int:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    value = config.get("max_position_embeddings") or 0
    return int(value) if isinstance(value, int) else 0
