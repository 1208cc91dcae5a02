"""docs/cli.md, ``--help``, ``--help-all`` and the args dataclasses say the same thing.

The page is generated (``python -m pdserve.cli_docs > docs/cli.md``): when a flag changes and
the page was not regenerated, the first test fails and says how to fix it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve import cli, cli_docs, config_cli

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
COMMANDS = cli_docs.flag_commands()
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def test_the_committed_page_is_the_generated_one() -> None:
    assert DOCS.read_text() == cli_docs.render(), (
        "docs/cli.md is stale: run `python -m pdserve.cli_docs > docs/cli.md`"
    )


def test_every_command_with_flags_is_generated() -> None:
    want = {"router", "up", "prefill-worker", "decode-worker", "generate", "operator"}
    assert want <= COMMANDS.keys()


def _section(name: str) -> str:
    text = DOCS.read_text()
    start = text.index(f"## pdserve {name}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _docs_flags(name: str) -> tuple[set[str], set[str]]:
    """(every flag, the bold ones) of the command's table rows."""
    rows = [r for r in _section(name).splitlines() if r.startswith("| ") and "`--" in r]
    cells = [r.split(" | ")[0] for r in rows]
    every = {f for c in cells for f in FLAG.findall(c)}
    bold = {f for c in cells if c.startswith("| **") for f in FLAG.findall(c)}
    return every, bold


def _help_flags(name: str, which: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    """The option flags that ``pdserve NAME WHICH`` lists (its own help flags aside)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, which])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    heads = [line.strip().split("  ")[0] for line in out.splitlines() if line.startswith("  -")]
    return {f for head in heads for f in FLAG.findall(head)} - {"--help", "--help-all"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_and_docs_list_the_same_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    every, bold = _docs_flags(name)
    help_all = _help_flags(name, "--help-all", capsys)
    assert help_all == every, f"--help-all vs docs/cli.md: {help_all ^ every}"
    short = _help_flags(name, "--help", capsys)
    assert short == bold, f"--help vs the bold flags of docs/cli.md: {short ^ bold}"
    assert 6 <= len(short) <= 16 and len(short) < len(help_all)  # the first dozen, not all


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_parsed_defaults_are_the_dataclass_defaults(name: str) -> None:
    """Parsing only the required flags gives every field its dataclass default."""
    classes = COMMANDS[name]
    parser = config_cli.build_parser(f"pdserve {name}", "", classes)
    required = [o for o in config_cli.all_options(classes) if o.spec.required]
    args = parser.parse_args([a for o in required for a in (o.name, "x")])
    for cls in classes:
        built = config_cli.from_namespace(cls, args)
        fresh = cls(**{o.field.name: "x" for o in config_cli.options(cls) if o.spec.required})
        assert built == fresh


def test_the_generator_refuses_a_flag_declared_twice() -> None:
    from pdserve.local.up_args import UpArgs

    with pytest.raises(AssertionError, match="declared twice"):
        config_cli.all_options((UpArgs, UpArgs))
