"""scripts/uv_args.py: pip's configuration as uv arguments (setup.sh installs with uv from
the sources pip would use, and falls back to pip on a setting it cannot translate)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "uv_args.py"


def uv_args(listing: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), listing], capture_output=True, text=True)


def test_this_machines_pip_config_translates() -> None:
    listing = "\n".join(
        [
            ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
            ":env:.find-links='/opt/wheels'",
            "global.constraint='/etc/xdg/pip/constraints.txt'",
            "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
            "global.find-links='/opt/wheels'",  # the same source from a file and the environment
        ]
    )
    out = uv_args(listing)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "--find-links",
        "/opt/wheels",
        "--constraint",
        "/etc/xdg/pip/constraints.txt",
        "--extra-index-url",
        "file:///opt/pypi/simple",
        "--extra-index-url",
        "file:///opt/pypi-more/simple",
    ]


@pytest.mark.parametrize(
    ("line", "want"),
    [
        (
            "global.index-url='https://mirror.example/simple'",
            ["--index-url", "https://mirror.example/simple"],
        ),
        ("global.no-index='true'", ["--no-index"]),
        ("global.no-index='false'", []),
        ("global.trusted-host='mirror.example'", ["--allow-insecure-host", "mirror.example"]),
        ("", []),
    ],
)
def test_each_source_setting(line: str, want: list[str]) -> None:
    out = uv_args(line)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == want


def test_a_setting_it_cannot_translate_sends_setup_back_to_pip() -> None:
    out = uv_args("global.extra-index-url='https://a/simple'\nglobal.prefer-binary='true'")
    assert out.returncode == 1
    assert "prefer-binary" in out.stderr and out.stdout == ""
