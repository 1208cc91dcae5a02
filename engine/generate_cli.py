"""``pdserve generate``: run the engine in-process on one prompt and stream the text.

    pdserve generate --model DIR --prompt "def main():" --max-tokens 64
    pdserve generate --model DIR --prompt "Hello" --chat --temperature 0.7 --seed 1

The generated text goes to stdout as it is produced; usage and speed go to stderr
at the end, so ``> out.txt`` captures exactly the completion.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

from pdserve.config_cli import add_flags, flag_group
from pdserve.engine.engine_args import EngineArgs, engine_config_from_args
from pdserve.protocol.sampling_params import InvalidParameter, SamplingParams

flag_gen = flag_group("generation")


@dataclass(frozen=True)
class GenerateArgs:
    """The prompt and how to sample its completion."""

    prompt: str = flag_gen(help="the prompt text", short=True, required=True)
    chat: bool = flag_gen(False, "wrap the prompt in the chat template", short=True)
    max_tokens: int = flag_gen(128, "tokens to generate at most", short=True)
    temperature: float = flag_gen(0.0, "0 is greedy", short=True)
    top_p: float = flag_gen(1.0, "nucleus sampling's probability mass")
    top_k: int = flag_gen(0, "sample from the k likeliest tokens (0: all)")
    seed: int | None = flag_gen(None, "the sampler's seed (default: random)")
    stop: tuple[str, ...] = flag_gen((), "a stop string (repeatable)", many="append")
    ignore_eos: bool = flag_gen(False, "go on past the end-of-sequence token")


FLAGS = (GenerateArgs, EngineArgs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, FLAGS)


def prompt_token_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidParameter("chat", "this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def run(args: argparse.Namespace) -> int:
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=list(args.stop),
            ignore_eos=args.ignore_eos,
        ).validate()
        config = engine_config_from_args(args)
    except (InvalidParameter, ValueError) as exc:
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    from pdserve.engine.llm_engine import LLMEngine  # torch loads only past the checks

    start = time.perf_counter()
    engine = LLMEngine(config)
    loaded = time.perf_counter()
    try:
        prompt = prompt_token_ids(engine.tokenizer, args.prompt, args.chat)
        engine.add_request("generate", prompt, params)
    except InvalidParameter as exc:
        print(f"pdserve generate: {exc.field}: {exc}", file=sys.stderr)
        return 2
    return _stream(engine, start, loaded)


def _stream(engine: Any, start: float, loaded: float) -> int:
    first_token_at = None
    final = None
    while engine.has_work:
        for out in engine.step():
            if first_token_at is None and out.token_ids:
                first_token_at = time.perf_counter()
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                final = out
    end = time.perf_counter()
    assert final is not None and first_token_at is not None
    sys.stdout.write("\n")
    n = final.num_output_tokens
    decode_s = end - first_token_at
    tok_s = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    blocks = engine.kv
    print(
        f"[{final.finish_reason}] prompt_tokens={final.num_prompt_tokens} completion_tokens={n} "
        f"load={loaded - start:.2f}s ttft={first_token_at - loaded:.3f}s "
        f"decode={tok_s:.1f} tok/s ({engine.config.dtype_name} on {engine.runner.device}) "
        f"kv_blocks_free={blocks.num_free_blocks}/{blocks.num_blocks}",
        file=sys.stderr,
    )
    return 0 if final.finish_reason in ("stop", "length") else 1
