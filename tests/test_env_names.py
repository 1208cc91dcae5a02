"""Every ``PDSERVE_*`` environment variable the product reads or sets is declared in
``pdserve/env.py`` (the one typed module for them); a name used anywhere else fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve import env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# The product: the package's folders (pdserve/<name> are links to them) and its chart.
PRODUCT = (
    "pdserve",
    "protocol",
    "router",
    "local",
    "worker",
    "engine",
    "operator",
    "planner",
    "transfer",
    "prefill_worker",
    "decode_worker",
    "charts",
)
NAME = re.compile(r"\bPDSERVE_[A-Z0-9][A-Z0-9_]*")


def _declared() -> set[str]:
    return {v for v in vars(env).values() if isinstance(v, str) and v.startswith("PDSERVE_")}


def _used() -> dict[str, list[str]]:
    """Name -> the files that mention it."""
    out: dict[str, list[str]] = {}
    for top in PRODUCT:
        base = ROOT / top
        if not base.is_dir() or base.is_symlink():
            continue
        for path in sorted(base.rglob("*")):
            if path.suffix not in (".py", ".yaml", ".yml", ".tpl", ".txt") or not path.is_file():
                continue
            for name in set(NAME.findall(path.read_text(errors="replace"))):
                out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def test_every_pdserve_variable_is_declared_in_env_py() -> None:
    used = _used()
    assert "PDSERVE_SERVICE_SECRET" in used  # the scan reaches the product's files
    missing = {n: files for n, files in used.items() if n not in _declared()}
    assert not missing, f"declare these in pdserve/env.py: {missing}"


def test_env_py_declares_the_admin_key() -> None:
    assert env.ADMIN_API_KEY == "PDSERVE_ADMIN_API_KEY"
