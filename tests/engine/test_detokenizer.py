"""Incremental detokenization and stop strings on the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

import random
import time

import pytest

from pdserve.engine.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopChecker,
    TextStream,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

MULTIBYTE = "Grüße 日本語のテキスト 😀🚀 👍🏽 naïve café — 中文，한국어 ❤️"


def _byte_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    table = _byte_bytes_to_unicode()
    ids = tokenizer.convert_tokens_to_ids([table[b] for b in text.encode()])
    assert None not in ids and tokenizer.unk_token_id not in ids
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    deltas = [detok.append(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*deltas, detok.flush()]


def test_byte_split_characters_are_never_emitted_partially(tiny_tokenizer) -> None:
    prompt = tiny_tokenizer("Prompt:").input_ids
    ids = byte_token_ids(tiny_tokenizer, MULTIBYTE)
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt)
    deltas = stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == detok.output_text
    # the 4-byte emoji arrives as 4 tokens: 3 empty deltas, then the whole character
    emoji_at = MULTIBYTE.encode().index("😀".encode())
    assert deltas[emoji_at : emoji_at + 4] == ["", "", "", "😀"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_merged_tokens_with_partial_characters(tiny_tokenizer, chunk: int) -> None:
    ids = tiny_tokenizer(MULTIBYTE * 3, add_special_tokens=False).input_ids
    assert any(REPLACEMENT_CHAR in tiny_tokenizer.decode([i]) for i in ids)  # real splits
    deltas = stream(
        IncrementalDetokenizer(tiny_tokenizer, [tiny_tokenizer.bos_token_id]), ids, chunk
    )
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE * 3


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode_for_random_sequences(
    tiny_tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    vocab = len(tiny_tokenizer)
    for _ in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        detok = IncrementalDetokenizer(tiny_tokenizer, prompt, skip_special_tokens)
        deltas = stream(detok, output, chunk=rng.choice([1, 1, 2, 5]))
        expected = tiny_tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, (prompt, output)


def test_special_tokens_are_skipped_or_kept(tiny_tokenizer) -> None:
    ids = [*tiny_tokenizer("hi", add_special_tokens=False).input_ids, tiny_tokenizer.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(tiny_tokenizer, []), ids)) == "hi"
    kept = "".join(stream(IncrementalDetokenizer(tiny_tokenizer, [], False), ids))
    assert kept == "hi" + tiny_tokenizer.eos_token


def test_resume_after_prefill_matches_single_stream(tiny_tokenizer) -> None:
    """Decode worker: prompt + first token (text already sent by the prefill side)."""
    prompt = tiny_tokenizer("Q:").input_ids
    ids = byte_token_ids(tiny_tokenizer, "😀 ok")  # first token is a partial emoji
    prefill = IncrementalDetokenizer(tiny_tokenizer, prompt)
    first_text = prefill.append(ids[:1])
    assert first_text == ""
    decode = IncrementalDetokenizer(tiny_tokenizer, prompt)
    decode.append(ids[:1])  # already sent: discard
    assert first_text + "".join(stream(decode, ids[1:])) == "😀 ok"


def test_work_per_call_does_not_grow_with_output_length(tiny_tokenizer) -> None:
    ids = tiny_tokenizer(MULTIBYTE * 400, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    timings, longest_window = [], 0
    for i in range(0, len(ids), 500):
        start = time.perf_counter()
        for tok in ids[i : i + 500]:
            detok.append([tok])
            longest_window = max(longest_window, len(detok.tokens))
        timings.append(time.perf_counter() - start)
    detok.flush()
    assert detok.output_text == MULTIBYTE * 400
    assert longest_window <= 80  # the decoded window stays bounded
    assert max(timings[-3:]) < 5 * min(timings[:3]) + 0.05
    assert sum(timings) / len(ids) < 500e-6  # generous; typically ~20 µs per token


def _feed_bytes(tokenizer, text: str, stop: list[str]) -> tuple[list[str], TextStream]:
    ts = TextStream(tokenizer, [tokenizer.bos_token_id], stop)
    out = []
    for tok in byte_token_ids(tokenizer, text):
        delta = ts.append([tok])
        out.append(delta.text)
        if delta.stop is not None:
            return out, ts
    out.append(ts.finish().text)
    return out, ts


def test_stop_string_spanning_tokens_is_never_partly_emitted(tiny_tokenizer) -> None:
    text = "Hello world STOP here"
    out, ts = _feed_bytes(tiny_tokenizer, text, ["STOP"])
    assert ts.stop_checker.stopped == "STOP"
    emitted = ""
    for piece in out:
        emitted += piece
        assert "Hello world ".startswith(emitted)  # never an "S", "ST" or "STO"
    assert emitted == ts.text == "Hello world "


def test_held_tail_is_released_when_the_match_fails(tiny_tokenizer) -> None:
    out, ts = _feed_bytes(tiny_tokenizer, "a STx STO", ["STOP"])
    assert ts.stop_checker.stopped is None
    assert "".join(out) == ts.text == "a STx STO"  # the held "STO" comes out at finish
    assert "".join(out[:-1]) == "a STx "


def test_stop_at_the_very_start(tiny_tokenizer) -> None:
    out, ts = _feed_bytes(tiny_tokenizer, "STOP and more", ["STOP"])
    assert "".join(out) == "" and ts.stop_checker.stopped == "STOP"


def test_earliest_of_several_stop_strings_wins() -> None:
    checker = StopChecker(["world", "lo w", "xyz"])
    assert checker.feed("Hel").text == "He"  # "l" could start "lo w"
    result = checker.feed("lo world")
    assert (result.text, result.stop) == ("l", "lo w")
    # found in one delta, the earlier occurrence wins regardless of list order
    result = StopChecker(["b", "a"]).feed("xxaxb")
    assert (result.text, result.stop) == ("xx", "a")


def test_multibyte_stop_string(tiny_tokenizer) -> None:
    out, ts = _feed_bytes(tiny_tokenizer, "日本語。次の文", ["。次"])
    assert "".join(out) == "日本語" and ts.stop_checker.stopped == "。次"


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.feed("anything").text == "anything" and checker.flush() == ""


def test_bad_stop_strings_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="non-empty strings"):
        StopChecker([""])
    with pytest.raises(ValueError, match="non-empty strings"):
        StopChecker([3])  # type: ignore[list-item]


def test_garbage_bytes_keep_the_window_bounded(tiny_tokenizer) -> None:
    """Lone continuation bytes never end on a character boundary; the window still moves."""
    ids = byte_token_ids(tiny_tokenizer, "é")[1:] * 500 + byte_token_ids(tiny_tokenizer, "ok")
    detok = IncrementalDetokenizer(tiny_tokenizer, [])
    deltas, longest = [], 0
    for tok in ids:
        deltas.append(detok.append([tok]))
        longest = max(longest, len(detok.tokens))
    deltas.append(detok.flush())
    assert longest <= 140
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == REPLACEMENT_CHAR * 500 + "ok"


def _resume_case(tokenizer, prompt: list[int], output: list[int], k: int) -> tuple[str, str]:
    """(what the first worker sends after ``k`` tokens, what a worker resumed with those
    ``k`` tokens sends): a migrated stream must continue exactly where the first stopped."""
    first = TextStream(tokenizer, prompt)
    for t in output[:k]:
        first.append([t])
    tail = "".join(first.append([t]).text for t in output[k:]) + first.finish().text
    resumed = TextStream(tokenizer, prompt)
    resumed.replay(output[:k])
    return tail, "".join(resumed.append([t]).text for t in output[k:]) + resumed.finish().text


def test_a_stream_resumed_elsewhere_continues_exactly(tiny_tokenizer) -> None:
    """Migration (router/transport/dispatch.py) resumes with every token already sent. A
    character held back at the cut (its bytes incomplete, or invalid bytes that a later
    token could still complete) must come out of the new worker once: replayed at once, a
    resume of more than MAX_WINDOW_TOKENS let the window skip it, and the text lost its
    U+FFFD (a stalled-worker test in tests/local/test_up_resilience.py caught it)."""
    ascii_ids = byte_token_ids(tiny_tokenizer, "x" * 70)
    emoji = byte_token_ids(tiny_tokenizer, "😀")
    output = [*ascii_ids, *emoji[:2], *emoji[2:], *byte_token_ids(tiny_tokenizer, " ok")]
    tail, resumed = _resume_case(tiny_tokenizer, [], output, len(ascii_ids) + 2)
    assert tail == "😀 ok" and resumed == tail
    invalid = [*ascii_ids, *emoji[:2], *byte_token_ids(tiny_tokenizer, "ab")]  # never completed
    tail, resumed = _resume_case(tiny_tokenizer, [], invalid, len(ascii_ids) + 2)
    assert tail.startswith(REPLACEMENT_CHAR) and resumed == tail
    rng = random.Random(99)
    vocab = len(tiny_tokenizer)
    for _ in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(2, 160))]
        k = rng.randint(1, len(output) - 1)
        tail, resumed = _resume_case(tiny_tokenizer, prompt, output, k)
        assert resumed == tail, (prompt, output, k)
