"""The flags every bench shares, so ``--quick`` means the same thing everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "out"


def add_common(parser: argparse.ArgumentParser, *, repeat: int = 3) -> argparse.ArgumentParser:
    """``--quick`` (a seconds-long run that checks the bench works: the test suite runs
    it, and it asserts no performance bound), ``--repeat N`` interleaved repetitions and
    ``--plot DIR`` (a PNG of the run)."""
    quick = "a short run that checks the bench works (the suite runs it)"
    parser.add_argument("--quick", action="store_true", help=quick)
    repeats = f"interleaved repetitions, reported as median and range (default {repeat})"
    parser.add_argument("--repeat", type=int, default=repeat, help=repeats)
    plot = f"draw the run as a PNG into this folder (default {OUT})"
    parser.add_argument("--plot", type=Path, nargs="?", const=OUT, default=None, help=plot)
    return parser


def parser(doc: str | None, quick: str) -> argparse.ArgumentParser:
    """A bench's parser: the first line of its docstring, and ``--quick`` with what a quick
    run is for this bench."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    p.add_argument("--quick", action="store_true", help=quick)
    return p


def add_ints(p: argparse.ArgumentParser, **defaults: int | tuple[int, ...]) -> None:
    """Integer flags as data: ``--name-with-dashes`` per keyword, in order, with its default;
    a tuple default takes that many values (``nargs``)."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, tuple):
            p.add_argument(flag, type=int, nargs=len(default), default=list(default))
        else:
            p.add_argument(flag, type=int, default=default)


def add_options(p: argparse.ArgumentParser, **specs: tuple[object, str]) -> None:
    """Flags with a help line as data: ``name=(default, help)`` per keyword, in order, as
    ``--name-with-dashes``. The default says the kind: ``False`` a switch, a number or a
    string a value of its type, a type itself (``float``) a value of that type that is
    ``None`` when not given."""
    for name, (default, text) in specs.items():
        flag = "--" + name.replace("_", "-")
        if default is False:
            p.add_argument(flag, action="store_true", help=text)
        elif isinstance(default, type):
            p.add_argument(flag, type=default, default=None, help=text)
        else:
            p.add_argument(flag, type=type(default), default=default, help=text)
