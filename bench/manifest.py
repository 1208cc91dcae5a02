"""Write the manifest.json of a recording folder, bench/recordings/<bench>/<date-label>/.

    python bench/manifest.py bench/recordings/router_throughput/2026-12-07-my-run \
        --command "python bench/router_throughput.py --repeat 3" [--commit HEAD] [--note TEXT]

The bench is the folder's parent's name, the date the label's (and its ``HHMM`` after the
date, where there is one), the files what the folder holds. ``--commit`` names the tree the
bench measured (default: this checkout's HEAD, the usual case for a run just made).
tests/docs/test_recordings_layout.py checks every folder has one (bench/recordings/README.md).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

LABEL = re.compile(r"(\d{4}-\d{2}-\d{2})(?:-(\d{2})(\d{2})(?=-|$))?")


def short_commit(rev: str) -> str | None:
    out = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def manifest(folder: Path, command: str, commit: str | None, note: str = "") -> dict:
    match = LABEL.match(folder.name)
    if match is None:
        raise SystemExit(f"{folder.name}: a recording's label starts with its date (YYYY-MM-DD)")
    date = match.group(1) + (f" {match.group(2)}:{match.group(3)} UTC" if match.group(2) else "")
    files = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    out = {
        "bench": folder.parent.name,
        "date": date,
        "label": folder.name,
        "command": command,
        "commit": commit,
        "added_in_commit": None,  # the commit that adds the folder is not known yet
        "files": files,
    }
    if note:
        out["note"] = note
    return out


def write(folder: Path, command: str, commit: str = "HEAD", note: str = "") -> dict:
    """Write ``folder``'s manifest.json, last (its files are what the folder holds now);
    ``commit`` a revision of this checkout ('' if unknown)."""
    out = manifest(folder, command, short_commit(commit) if commit else None, note)
    (folder / "manifest.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="bench/recordings/<bench>/<date-label>")
    ap.add_argument("--command", required=True, help="the command that made the recording")
    ap.add_argument("--commit", default="HEAD", help="the tree measured ('' if unknown)")
    ap.add_argument("--note", default="", help="one line on the run (its NOTES.md says more)")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"{args.folder}: no such folder")
    print(json.dumps(write(args.folder, args.command, args.commit, args.note)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
