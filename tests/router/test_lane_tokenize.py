"""Text prompts tokenized by the compiled lane (rust/router_lane/src/tokenize.rs) give the
ids the Python router's tokenizer gives (``PromptTokenizer.encode``, the reference): the
lane loads the router's own backend tokenizer as JSON (``backend_json``) into the Rust
library the Python binding wraps. Compared on many strings (unicode of many scripts,
combining marks, emoji sequences, control characters, whitespace runs, the tokenizer's
special tokens alone, inside words and half-written) over the tiny model's tokenizer and
two built here (a WordPiece with a BERT normalizer, a Metaspace BPE with NFKC and byte
fallback). Then the body's prompt as the lane reads it, and a cluster whose text
requests are served with the lane's ids (the Python tokenizer not called for them).

Skipped where the module is not built (scripts/setup.sh builds it when cargo is there).
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from pdserve.router.api.serving import INLINE_TEXT_CHARS
from pdserve.testing.lane import lane_mod, needs_lane
from tests.router.conftest import start_cluster

pytestmark = pytest.mark.unit

FIXED = [
    "",
    " ",
    "hello world",
    "  leading and trailing  ",
    "tabs\tand\nnewlines\r\nand\x0bvertical\x0cfeeds",
    "naïve café résumé Ångström",
    "e\u0301 combining a\u0308 o\u0328\u0301",
    "日本語のテキストと中文文本，한국어 텍스트",
    "مرحبا بالعالم שלום עולם",
    "हिन्दी पाठ ภาษาไทย",
    "emoji 👩‍👩‍👧 👍🏽 🇫🇷 ❤️ 🧑🏿‍🚀",
    "controls \x00 \x01 \x1b[31m \x7f \u200b \u200d \ufeff bom",
    "nbsp\u00a0ideographic\u3000space\u2028line\u2029para",
    "numbers 1234567890 3.14159 -42 1e10 0x1F",
    "code: def f(x):\n    return {'a': [1, 2]}  # ok",
    "quotes \"double\" 'single' `back` «guillemets» „low”",
    "a" * 1000,
    "ab " * 300,
    "\U0001f600" * 50,
    "MiXeD CaSe WoRdS",
    "w12 w345 w6 w78 w9",
]


def _random_texts(rng: random.Random, specials: list[str], n: int) -> list[str]:
    """Strings drawn from several scripts and classes of characters, with the special
    tokens spliced in whole and cut short."""
    ranges = [
        (0x20, 0x7E),
        (0x00, 0x1F),
        (0xA0, 0x24F),
        (0x300, 0x36F),  # combining marks
        (0x370, 0x52F),
        (0x590, 0x6FF),
        (0x900, 0x97F),
        (0x3040, 0x30FF),
        (0x4E00, 0x4FFF),
        (0xAC00, 0xAD00),
        (0x1F300, 0x1F6FF),
        (0xE000, 0xE0FF),  # private use
        (0x10000, 0x1007F),
    ]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randrange(1, 12)):
            r = rng.random()
            if r < 0.15 and specials:
                s = rng.choice(specials)
                parts.append(s if rng.random() < 0.7 else s[: rng.randrange(1, len(s))])
            elif r < 0.3:
                parts.append(rng.choice([" ", "  ", "\n", "\t", " \n ", "\u00a0"]))
            else:
                lo, hi = rng.choice(ranges)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randrange(1, 9))))
        out.append("".join(parts))
    return out


def _texts(specials: list[str]) -> list[str]:
    rng = random.Random(47)
    around = [f"x{s}y {s}{s} {s} " for s in specials]
    return FIXED + around + _random_texts(rng, specials, 600)


@needs_lane
def test_the_lane_tokenizes_as_the_router(router_tokenizer) -> None:
    tok = router_tokenizer
    specials = [str(t) for t in tok.tok.all_special_tokens] + list(
        tok.tok.backend_tokenizer.get_added_tokens_decoder()[i].content
        for i in tok.tok.backend_tokenizer.get_added_tokens_decoder()
    )
    assert specials  # the tiny tokenizer has some: they must be in the texts
    texts = _texts(sorted(set(specials)))
    json_ = tok.backend_json()
    assert json_ is not None
    for add in (True, False):
        got = lane_mod.tokenize(json_, texts, add)
        want = [tok.encode(t, add_special_tokens=add) for t in texts]
        bad = [t for t, g, w in zip(texts, got, want, strict=True) if g != w]
        assert not bad, f"{len(bad)} of {len(texts)} differ, e.g. {bad[:3]!r}"
    # not vacuous: the texts hit the special tokens and the post-processor's additions
    ids = lane_mod.tokenize(json_, ["hello"], True)[0]
    assert ids != lane_mod.tokenize(json_, ["hello"], False)[0]


def _built() -> list[Any]:
    """Tokenizers of other shapes than the tiny model's, built with the Python binding."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5, "caf": 6}
    vocab.update({c: i + 7 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz日本")})
    wp = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    wp.add_special_tokens(["[CLS]", "[SEP]"])

    sp = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    sp.normalizer = normalizers.NFKC()
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    corpus = [" ".join(FIXED)] * 3 + _random_texts(random.Random(1), [], 200)
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    sp.train_from_iterator(
        corpus, BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", *bytes_])
    )
    sp.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", sp.token_to_id("<s>"))]
    )
    return [wp, sp]


@needs_lane
def test_other_tokenizer_shapes_agree() -> None:
    for tok in _built():
        texts = _texts(["[CLS]", "[SEP]", "<s>", "<unk>"])
        for add in (True, False):
            want = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=add)]
            assert lane_mod.tokenize(tok.to_str(), texts, add) == want


@needs_lane
def test_the_body_prompt_as_the_lane_reads_it(router_tokenizer) -> None:
    """Only a JSON object's string ``prompt`` up to INLINE_TEXT_CHARS characters (the
    Python lane's inline limit, in characters, not bytes) is tokenized; the last of
    duplicate keys counts, as in Python's json."""
    j, n = router_tokenizer.backend_json(), INLINE_TEXT_CHARS

    def read(body: bytes) -> Any:
        return lane_mod.body_prompt(j, n, body)

    text = "héllo wörld 👍"
    got = read(json.dumps({"model": "tiny", "prompt": text, "max_tokens": 3}).encode())
    assert got == (text, router_tokenizer.encode(text))
    assert read(b'{"prompt": "caf\\u00e9"}') == ("café", router_tokenizer.encode("café"))
    assert read(b'{"prompt": "a", "prompt": "b c"}')[0] == "b c"
    assert read(json.dumps({"prompt": "é" * n}).encode())[0] == "é" * n
    for body in (
        json.dumps({"prompt": "é" * (n + 1)}).encode(),  # a thread's, on the Python lane
        json.dumps({"prompt": [1, 2, 3]}).encode(),
        json.dumps({"prompt": ["a", "b"]}).encode(),
        json.dumps(["prompt", "a"]).encode(),
        b'{"prompt": "\\ud800 lone"}',  # Python's json takes it; Python tokenizes it
        b'{"prompt": "a"',
        b"\xff\xfe",
        b"{}",
    ):
        assert read(body) is None, body


@needs_lane
async def test_text_requests_use_the_lanes_ids(
    router_tokenizer, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a cluster: text prompts are served with the lane's ids (the Python
    tokenizer is not called for them) and the replies are the Python lane's; a tokenizer
    whose settings moved (truncation on) is not trusted: Python tokenizes again."""
    bodies = [
        {"prompt": "hello there naïve 👍", "max_tokens": 3},
        {"prompt": "a b c", "max_tokens": 2, "stream": True},
    ]
    replies = {}
    for lane in (False, True):
        async with start_cluster(router_tokenizer, tiny_model_dir, lane=lane) as c:
            calls: list[str] = []
            real = router_tokenizer.encode

            def counted(text: str, _real: Any = real, _calls: Any = calls, **kw: Any) -> Any:
                _calls.append(text)
                return _real(text, **kw)

            monkeypatch.setattr(router_tokenizer, "encode", counted)
            async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
                replies[lane] = [
                    _reply(await h.post("/v1/completions", json={"model": "tiny", **b}))
                    for b in bodies
                ]
                assert calls == ([] if lane else [b["prompt"] for b in bodies])
                if lane:
                    assert c.app.state.lane.host.served == len(bodies)
                    backend = router_tokenizer.tok.backend_tokenizer
                    backend.enable_truncation(512)
                    try:
                        r = await h.post("/v1/completions", json={"model": "tiny", **bodies[0]})
                    finally:
                        backend.no_truncation()
                    assert r.status_code == 200 and calls == [bodies[0]["prompt"]]
            monkeypatch.undo()
            await c.settle()
    assert replies[True] == replies[False]
    assert [r[0] for r in replies[True]] == [200, 200]


def _reply(r: httpx.Response) -> tuple[int, str, int | None]:
    """Status, completion text and prompt tokens (a stream's text joined; its usage is not
    sent unless asked)."""
    if r.headers["content-type"].startswith("text/event-stream"):
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line[:7] == "data: {"]
        return r.status_code, "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), None
    body = r.json()
    return r.status_code, body["choices"][0]["text"], body["usage"]["prompt_tokens"]
