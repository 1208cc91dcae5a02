"""Every relative markdown link in README.md and docs/*.md resolves to a file of this
repository (a link outside the repository is allowed only as an absolute http(s) URL),
and docs/README.md indexes every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# [text](target) and ![alt](target), the target up to a space or the closing bracket
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _links(page: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for line_no, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out += [(line_no, target) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))]
    return out


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in _pages():
        for line_no, target in _links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL (http, mailto) or an anchor on the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}:{line_no}: {target}")
    assert not broken, "\n".join(broken)


def test_no_link_to_a_local_path_outside_the_repository() -> None:
    outside = [
        f"{page.relative_to(ROOT)}:{n}: {t}"
        for page in _pages()
        for n, t in _links(page)
        if t.startswith(("/", "file:", "~"))
    ]
    assert not outside, "\n".join(outside)


def test_docs_index_names_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    named = {t.split("#", 1)[0] for _, t in _links(DOCS / "README.md")}
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert not pages - named, f"docs/README.md lacks: {sorted(pages - named)}"
    assert index.count("\n- ") >= len(pages)
