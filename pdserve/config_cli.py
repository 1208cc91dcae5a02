"""Command-line flags generated from config dataclasses: one source for flags, config and docs.

A command's flags are the fields of its args dataclasses (``router/args.py``,
``local/up_args.py``, ``worker/args.py``, ``engine/engine_args.py``), each declared with
:func:`flag`, whose metadata carries the help, the group, the choices and whether ``--help``
shows it. The argparse parser, the short ``--help``, ``--help-all`` and ``docs/cli.md``
(``python -m pdserve.cli_docs``) are all built from those fields, as vLLM builds its CLI from
``EngineArgs``: a flag cannot be added to one and missed by the others.

Name, type and action follow from the field: ``--field-name``; the annotation's type (the
element type of a tuple); a bool is a switch (``--no-x`` as well when it defaults to True); a
tuple collects repeated flags (``append``) or several values (``nargs="+"``, ``extend``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, Field, dataclass
from typing import Any

HELP_ALL = "--help-all"


@dataclass(frozen=True)
class Flag:
    """What a field's flag needs beyond its name, type and default."""

    help: str
    group: str  # the named section of --help-all and docs/cli.md
    short: bool = False  # shown by --help (the dozen a user needs first)
    choices: Sequence[str] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # argparse's ``type`` (default: the annotation's)
    name: str = ""  # the flag, where it is not --field-name
    many: str = ""  # tuples: "append" (repeat the flag) or "extend" (several values at once)
    exclusive: str = ""  # flags of one name here exclude each other
    required: bool = False
    env: str = ""  # an environment variable the command reads when the flag is not given
    aliases: tuple[str, ...] = ()  # short forms: ("-n",)


def flag(default: Any = MISSING, help: str = "", *, group: str, **kw: Any) -> Any:
    """A dataclass field that is also a command-line flag (the keywords: :class:`Flag`)."""
    meta = {"cli": Flag(help=help, group=group, **kw)}
    return dataclasses.field(default=default, metadata=meta)


def flag_group(group: str) -> Callable[..., Any]:
    """:func:`flag` for the fields of one group: a dataclass names each group once, as
    ``limit = flag_group(LIMITS)``, and its fields say ``limit(256, "help")``."""
    return functools.partial(flag, group=group)


def checked(parse: Callable[[str], Any], keep_text: bool = False) -> Callable[[str], Any]:
    """A flag's ``parse`` from a parser that raises ValueError: argparse then names the flag
    in its error. The flag's value is what ``parse`` returns, or with ``keep_text`` the text
    itself (checked at parse time, parsed where it is used)."""

    def check(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text if keep_text else value

    check.__name__ = getattr(parse, "__name__", "value")
    return check


@dataclass(frozen=True)
class Option:
    """One field resolved: everything argparse and the docs need."""

    field: Field[Any]
    spec: Flag
    type: Any  # the element type (int, float, str, bool)
    repeated: bool

    @property
    def name(self) -> str:
        return self.spec.name or "--" + self.field.name.replace("_", "-")

    @property
    def default(self) -> Any:
        return None if self.field.default is MISSING else self.field.default

    @property
    def switch(self) -> bool:
        return self.type is bool and not self.repeated

    @property
    def negatable(self) -> bool:
        return self.switch and self.default is True

    @property
    def value_name(self) -> str:
        """What the flag takes, as argparse writes it: ``URL``, ``{a,b}``; "" for a switch."""
        if self.switch:
            return ""
        if self.spec.choices:
            return "{" + ",".join(self.spec.choices) + "}"
        return self.spec.metavar or self.field.name.upper()

    def help_text(self, with_default: bool = True) -> str:
        """The help, its environment variable and (``with_default``) its default, unless
        the help says it already."""
        text, default = self.spec.help, self.default
        if self.spec.env and self.spec.env not in text:
            text += f" (or env {self.spec.env})"
        unset = default is None or default is False or default in ("", ())
        if not with_default or unset or "default" in text:
            return text
        if self.negatable:
            return f"{text} (default: on)".lstrip()
        return f"{text} (default: {default})".lstrip()

    def kwargs(self) -> dict[str, Any]:
        """argparse's ``add_argument`` keywords."""
        kw: dict[str, Any] = {"dest": self.field.name, "help": self.help_text()}
        if self.switch:
            action = argparse.BooleanOptionalAction if self.negatable else "store_true"
            return {**kw, "action": action, "default": self.default}
        kw["type"] = self.spec.parse or self.type
        kw["metavar"] = self.spec.metavar
        if self.spec.choices:
            kw["choices"] = self.spec.choices
        if self.spec.required:
            return {**kw, "required": True}
        if self.repeated:
            extend = self.spec.many == "extend"
            kw.update(action="extend" if extend else "append", nargs="+" if extend else None)
            return {**kw, "default": list(self.default or ())}  # argparse appends to a list
        return {**kw, "default": self.default}


def options(cls: type) -> Iterator[Option]:
    """The flags of one args dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("cli")
        if spec is None:
            continue
        elem, repeated = _element_type(hints[f.name])
        yield Option(f, spec, elem, repeated)


def _element_type(hint: Any) -> tuple[Any, bool]:
    """``int | None`` → (int, False); ``tuple[str, ...]`` → (str, True)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        assert len(args) == 1, f"one type besides None: {hint}"
        return _element_type(args[0])
    if origin in (tuple, list):
        inner = typing.get_args(hint)[0]
        return (inner if isinstance(inner, type) else str), True
    assert isinstance(hint, type), f"a flag's field needs a plain type, not {hint}"
    return hint, False


def all_options(classes: Sequence[type]) -> list[Option]:
    out = [o for cls in classes for o in options(cls)]
    names = [o.name for o in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"flags declared twice: {dupes}"
    return out


def groups(classes: Sequence[type]) -> dict[str, list[Option]]:
    """Group name → its options, groups in the order of their first field."""
    out: dict[str, list[Option]] = {}
    for o in all_options(classes):
        out.setdefault(o.spec.group, []).append(o)
    return out


def add_flags(
    parser: argparse.ArgumentParser, classes: Sequence[type], short: bool = False
) -> None:
    """Every flag of ``classes`` in its named group (``short``: only the --help ones)."""
    for title, opts in groups(classes).items():
        chosen = [o for o in opts if o.spec.short or not short]
        if not chosen:
            continue
        section = parser.add_argument_group(title)
        exclusive: dict[str, Any] = {}
        for o in chosen:
            target: Any = section
            if o.spec.exclusive and not short:
                if o.spec.exclusive not in exclusive:
                    exclusive[o.spec.exclusive] = section.add_mutually_exclusive_group()
                target = exclusive[o.spec.exclusive]
            target.add_argument(o.name, *o.spec.aliases, **o.kwargs())


def build_parser(prog: str, description: str, classes: Sequence[type]) -> argparse.ArgumentParser:
    """The command's parser: every flag, ``-h/--help`` (the short list) and ``--help-all``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, add_help=False)
    _add_help_flags(parser, classes)
    add_flags(parser, classes)
    return parser


def _add_help_flags(parser: argparse.ArgumentParser, classes: Sequence[type]) -> None:
    helps = parser.add_argument_group("help")
    helps.add_argument(
        "-h",
        "--help",
        action=_PrintHelp,
        nargs=0,
        short_of=classes,
        help="the flags to start with, and the groups of the rest",
    )
    helps.add_argument(
        HELP_ALL,
        action=_PrintHelp,
        nargs=0,
        short_of=None,
        help="every flag, by group (also docs/cli.md)",
    )


def short_help(parser: argparse.ArgumentParser, classes: Sequence[type]) -> str:
    """``--help``: the short flags, then the names of the groups ``--help-all`` adds."""
    short = argparse.ArgumentParser(
        prog=parser.prog,
        description=parser.description,
        add_help=False,
        epilog=_groups_epilog(parser.prog, classes),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_help_flags(short, classes)
    add_flags(short, classes, short=True)
    return short.format_help()


def _groups_epilog(prog: str, classes: Sequence[type]) -> str:
    lines = [f"more flags ({prog} {HELP_ALL} shows them all; docs/cli.md):"]
    for title, opts in groups(classes).items():
        rest = [o for o in opts if not o.spec.short]
        if rest:
            lines.append(f"  {title}: {len(rest)} more")
    return "\n".join(lines) if len(lines) > 1 else ""


class _PrintHelp(argparse.Action):
    def __init__(self, *args: Any, short_of: Sequence[type] | None, **kw: Any) -> None:
        kw.update(default=argparse.SUPPRESS, dest=argparse.SUPPRESS)
        super().__init__(*args, **kw)
        self.short_of = short_of

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        text = short_help(parser, self.short_of) if self.short_of else parser.format_help()
        parser._print_message(text, sys.stdout)
        parser.exit()


def from_namespace(cls: type[Any], ns: argparse.Namespace) -> Any:
    """The typed args dataclass from parsed flags (lists become tuples)."""
    values = {}
    for o in options(cls):
        value = getattr(ns, o.field.name)
        values[o.field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)
