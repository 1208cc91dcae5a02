"""The generator (pdserve/config_cli.py): a toy args dataclass becomes the parser it says."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve.config_cli import build_parser, flag, flag_group, from_namespace, options, short_help

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Toy:
    model: str = flag(help="the model", group="main", short=True, required=True)
    port: int = flag(8000, "HTTP port", group="main", short=True, aliases=("-p",))
    ratio: float | None = flag(None, "a share", group="more")
    mode: str = flag("a", "the mode", group="more", choices=("a", "b"))
    fast: bool = flag(False, "go fast", group="more")
    zygote: bool = flag(True, "fork from a zygote", group="more")
    url: tuple[str, ...] = flag((), "URLs", group="more", metavar="URL", many="extend")
    tag: tuple[int, ...] = flag((), "a tag (repeatable)", group="more", many="append")
    key: str = flag("", "a key", group="keys", exclusive="key", env="PDSERVE_API_KEY")
    key_file: str = flag("", "a key file", group="keys", exclusive="key")


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser("toy", "a toy", (Toy,)).parse_args(list(argv))


def test_types_actions_and_defaults_follow_the_fields() -> None:
    ns = _parse(
        "--model",
        "m",
        "-p",
        "9",
        "--ratio",
        "0.5",
        "--mode",
        "b",
        "--fast",
        "--no-zygote",
        "--url",
        "u1",
        "u2",
        "--tag",
        "1",
        "--tag",
        "2",
    )
    toy = from_namespace(Toy, ns)
    assert toy == Toy(
        model="m",
        port=9,
        ratio=0.5,
        mode="b",
        fast=True,
        zygote=False,
        url=("u1", "u2"),
        tag=(1, 2),
    )
    assert from_namespace(Toy, _parse("--model", "m")) == Toy(model="m")


@pytest.mark.parametrize(
    "argv",
    [
        (),  # --model is required
        ("--model", "m", "--mode", "c"),  # not a choice
        ("--model", "m", "--port", "x"),  # not an int
        ("--model", "m", "--key", "k", "--key-file", "f"),  # exclusive
    ],
)
def test_bad_flags_are_refused_by_name(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit):
        _parse(*argv)


def test_the_short_help_lists_the_short_flags_and_names_the_groups() -> None:
    parser = build_parser("toy", "a toy", (Toy,))
    text = short_help(parser, (Toy,))
    assert "--model" in text and "--port" in text and "-p" in text
    assert "--ratio" not in text and "more: 6 more" in text and "keys: 2 more" in text
    full = parser.format_help()
    assert "--ratio" in full and "(default: 8000)" in full and "(or env PDSERVE_API_KEY)" in full


def test_a_group_helper_is_flag_with_its_group() -> None:
    """``flag_group(G)(...)`` declares the field ``flag(..., group=G)`` does: one name for
    the group per dataclass, the same flag."""
    flag_more = flag_group("more")

    @dataclass(frozen=True)
    class Grouped:
        mode: str = flag_more("a", "the mode", choices=("a", "b"))
        url: tuple[str, ...] = flag_more((), "URLs", metavar="URL", many="extend")

    grouped = {o.field.name: o for o in options(Grouped)}
    toy = {o.field.name: o for o in options(Toy)}
    for name in ("mode", "url"):
        assert grouped[name].spec == toy[name].spec
        assert grouped[name].default == toy[name].default
