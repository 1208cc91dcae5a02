"""pip's configuration as uv arguments, one per line: uv reads none of pip's files or PIP_*
variables, and setup.sh must install from the same sources pip would (find-links, index
URLs, constraints; on this machine torch comes from a local wheel and is capped by a
constraints file). Exits 1, and setup.sh falls back to pip, when pip is configured with
a setting this does not translate.

    python scripts/uv_args.py "$(pip config list)"
"""

from __future__ import annotations

import itertools
import shlex
import sys

# pip's key -> uv's flag; the value may hold several, whitespace-separated
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
# settings that do not change what is installed (cert is passed as SSL_CERT_FILE)
HARMLESS = {
    "cert",
    "default-timeout",
    "disable-pip-version-check",
    "timeout",
    "retries",
    "progress-bar",
    "no-color",
    "quiet",
    "verbose",
    "root-user-action",
    "no-cache-dir",
}


def translate(listing: str) -> list[str]:
    args: list[str] = []
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]  # "global.find-links", ":env:.find-links"
        values = shlex.split(raw)[0].split() if raw.strip() else []
        if name in FLAGS:
            for value in values:
                if not _seen(args, FLAGS[name], value):  # pip lists env and file alike
                    args += [FLAGS[name], value]
        elif name == "no-index":
            if values and values[0].lower() in ("1", "true", "yes", "on"):
                args.append("--no-index")
        elif name not in HARMLESS:
            raise ValueError(f"pip setting {key!r} has no uv translation here")
    return args


def _seen(args: list[str], flag: str, value: str) -> bool:
    return any(a == flag and b == value for a, b in itertools.pairwise(args))


def main(argv: list[str]) -> int:
    try:
        print("\n".join(translate(argv[1] if len(argv) > 1 else "")))
    except ValueError as exc:
        print(f"uv_args: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
