"""The router loads the tokenizer AutoTokenizer would, and no torch where it can.

``router/tokenizer.load_tokenizer`` loads transformers' generic backend directly for the
model types listed in ``DIRECT_MODEL_TYPES`` (AutoTokenizer's own resolution imports torch:
~2 CPU-s and ~250 MB in every router process). Served token ids must not change for it:
these tests hold the list to the installed transformers' tables and compare both loads on
a model directory of every family the engine serves.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.router.tokenizer import (
    CHECKED_TRANSFORMERS,
    DIRECT_MODEL_TYPES,
    direct_load_checked,
    load_tokenizer,
)
from tests.model_families import FAMILIES, Family, make_config

pytestmark = pytest.mark.unit

TEXT = "Hello world, the capital of France is Paris. <|im_start|> 1234 naïve café\n\tend"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]


def test_direct_model_types_keep_a_declared_generic_class() -> None:
    """The list against the installed release's tables. On a release outside
    CHECKED_TRANSFORMERS the router does not use the list (AutoTokenizer loads); the test
    then says whether the list would hold on it, so the range can be widened."""
    from transformers import __version__
    from transformers.models.auto import tokenization_auto as auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    mistral = {
        t for t, name in auto.TOKENIZER_MAPPING_NAMES.items() if name == "MistralCommonBackend"
    }
    wrong = DIRECT_MODEL_TYPES - set(CONFIG_MAPPING_NAMES)  # typos
    wrong |= DIRECT_MODEL_TYPES & (auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS | mistral)
    if not direct_load_checked():
        verdict = f"the list is wrong for {sorted(wrong)}" if wrong else "widen the range"
        pytest.skip(
            f"transformers {__version__} is outside CHECKED_TRANSFORMERS (the router "
            f"loads through AutoTokenizer on it): {verdict}"
        )
    assert not wrong


def _family_dir(tokenizer_dir: Path, family: Family, out: Path) -> Path:
    """A directory with the tiny model's tokenizer and a family's config.json: what
    AutoTokenizer reads to pick the class (no weights needed)."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    make_config(family, 3072, {}).save_pretrained(out)
    return out


def test_every_family_loads_what_autotokenizer_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    direct = []
    for i, family in enumerate(FAMILIES):
        path = _family_dir(tiny_model_dir, family, tmp_path / str(i))
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
        assert type(ours) is type(auto), family.id
        assert ours.encode(TEXT) == auto.encode(TEXT), family.id
        assert ours.chat_template == auto.chat_template, family.id
        rendered = [
            tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            for tok in (ours, auto)
        ]
        assert rendered[0] == rendered[1], family.id
        if type(auto).__name__ == "TokenizersBackend":
            direct.append(family.id)
        else:  # AutoTokenizer picked a model-specific class: so must the router
            assert family.config_class in ("Qwen2Config", "Phi3Config"), family.id
    # both ways are exercised: most families load directly, qwen2 and phi3 get their own class
    assert len(direct) >= 15 and len(direct) < len(FAMILIES), direct


@pytest.mark.parametrize(
    ("release", "direct"),
    [
        ("5.24.0", True),
        ("5.25.1", True),
        ("5.17.0", False),
        ("5.26.0.dev0", False),
        ("4.57.1", False),
        ("6.0.0", False),
        ("garbage", False),
    ],
)
def test_only_checked_transformers_releases_load_directly(release: str, direct: bool) -> None:
    assert CHECKED_TRANSFORMERS[0] == (5, 24)  # the first release the list was checked on
    assert direct_load_checked(release) is direct


def test_the_router_tokenizer_imports_no_torch(tiny_model_dir: Path) -> None:
    """On a transformers release outside CHECKED_TRANSFORMERS the router loads through
    AutoTokenizer, torch with it (the test above says whether the range can be widened)."""
    if not direct_load_checked():
        pytest.skip("transformers release outside CHECKED_TRANSFORMERS: AutoTokenizer loads")
    probe = (
        "import sys; from pdserve.router.tokenizer import PromptTokenizer; "
        f"t = PromptTokenizer({str(tiny_model_dir)!r}); t.encode('hello'); "
        "t.encode_chat([{'role': 'user', 'content': 'hi'}]); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"


FAST_TEXTS = [
    TEXT,
    "",
    " ",
    "w12 w345 w6 " * 40,
    "<|im_start|>user\nhi<|im_end|>",
    "emoji 🙂 and 漢字 and \u200b zero-width, \r\n crlf",
    "x" * 3000,
]


def test_the_fast_encode_gives_what_transformers_encode_gives(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``PromptTokenizer.encode`` skips transformers' wrapper (the Rust backend's
    ``encode_batch_fast``) where the wrapper adds nothing: the same ids on every family's
    tokenizer, with and without special tokens; and, when the backend was set to truncate
    (a setting the wrapper resets), the wrapper's ids through the wrapper."""
    from pdserve.router.tokenizer import PromptTokenizer

    fast = 0
    for i, family in enumerate(FAMILIES):
        tok = PromptTokenizer(str(_family_dir(tiny_model_dir, family, tmp_path / str(i))))
        fast += tok._fast is not None
        for text in FAST_TEXTS:
            for special in (True, False):
                want = list(tok.tok.encode(text, add_special_tokens=special))
                assert tok.encode(text, special) == want, (family.id, text[:20], special)
        if tok._fast is not None:
            tok.tok.backend_tokenizer.enable_truncation(max_length=3)
            assert tok.encode(FAST_TEXTS[3]) == list(tok.tok.encode(FAST_TEXTS[3]))
            assert len(tok.encode(FAST_TEXTS[3])) > 3  # the wrapper reset the truncation
    assert fast >= 15, fast  # the generic backend's families take the fast path
