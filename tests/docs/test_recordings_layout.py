"""bench/recordings/ is laid out as <bench>/<date-label>/, each run with a manifest.json
naming its bench, and every recording path that README.md and docs/ name exists."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = ROOT / "bench" / "recordings"
RUNS = sorted(p for p in RECORDINGS.glob("*/*") if p.is_dir())
# `bench/recordings/...` as written in prose or a command, up to a space, quote or bracket;
# `{a,b}`, `<placeholder>` and `$(command)` are parts of it
MENTION = re.compile(r"bench/recordings/(?:\{[^}]*\}|<[^>]*>|\$\([^)]*\)|[^\s`'\")\]|,:;{<$])*")
# recordings that are not a script of bench/
NOT_A_SCRIPT = {"make_test"}


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def _check(run: Path, manifest: dict) -> None:
    bench = run.parent.name
    assert manifest["bench"] == bench, run
    assert manifest["label"] == run.name, run
    assert re.match(r"\d{4}-\d{2}-\d{2}", run.name), f"{run}: the label starts with its date"
    assert manifest["command"] and manifest["date"].startswith(run.name[:10]), run
    assert bench in NOT_A_SCRIPT or (ROOT / "bench" / f"{bench}.py").is_file(), run
    files = {p.name for p in run.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files, run


def test_every_run_has_a_manifest_naming_its_bench() -> None:
    assert len(RUNS) > 50
    for run in RUNS:
        _check(run, json.loads((run / "manifest.json").read_text()))


def _write_manifest(run: Path, check: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "bench/manifest.py"), str(run), "--command", "python x"]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, cwd=ROOT)


def test_bench_manifest_writes_what_the_check_wants(tmp_path: Path) -> None:
    run = tmp_path / "serve" / "2026-12-07-0130-a-run"
    run.mkdir(parents=True)
    (run / "serve.json").write_text("{}\n")
    _write_manifest(run, check=True)
    manifest = json.loads((run / "manifest.json").read_text())
    _check(run, manifest)
    assert manifest["date"] == "2026-12-07 01:30 UTC" and manifest["files"] == ["serve.json"]
    assert manifest["commit"]  # this checkout's HEAD
    bad = tmp_path / "serve" / "no-date"
    bad.mkdir()
    out = _write_manifest(bad, check=False)
    assert out.returncode != 0 and "starts with its date" in out.stderr


def test_a_calibration_kept_by_default_gets_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/sim_vs_real_scaling.py --calibrate, the one bench that makes its own folder
    under bench/recordings/, writes the manifest there (the run itself faked)."""
    import sim_vs_real_scaling as scaling

    def record_real(work: Path, *_: object) -> dict:
        (work / "real.json").write_text("{}")
        return {"real": {}}

    folder = tmp_path / "sim_vs_real_scaling"
    monkeypatch.setattr(scaling, "RECORDINGS", folder)
    monkeypatch.setattr(scaling, "measure_profile", lambda _m, path, quick: Path(path).touch())
    monkeypatch.setattr(scaling, "record_real", record_real)
    assert scaling.main(["--calibrate", "--model", "m", "--quick"]) == 0
    (run,) = folder.iterdir()
    manifest = json.loads((run / "manifest.json").read_text())
    _check(run, manifest)
    assert manifest["files"] == ["profile.json", "real.json"]
    command = "python bench/sim_vs_real_scaling.py --calibrate --model m --quick"
    assert manifest["command"] == command


def test_no_run_lies_outside_a_bench_folder() -> None:
    loose = [p for p in RECORDINGS.iterdir() if p.is_dir() and re.match(r"\d{4}-", p.name)]
    assert not loose, f"move these under bench/recordings/<bench>/: {loose}"


def test_a_bench_folder_holds_runs_and_a_readme_at_most() -> None:
    """Beside the runs, a README.md (an overview) and nothing else, at either level."""
    files = [p for p in [*RECORDINGS.glob("*"), *RECORDINGS.glob("*/*")] if not p.is_dir()]
    assert [p for p in files if p.name != "README.md"] == []
    benches = [p for p in RECORDINGS.iterdir() if p.is_dir()]
    assert [p for p in benches if not any(run.is_dir() for run in p.iterdir())] == []


def _expand(path: str) -> list[str]:
    """`2026-12-04-{1636,1641}-x` -> both names; `..` ranges and `*`/`<...>` -> a glob."""
    braces = re.search(r"\{([^}]*)\}", path)
    if braces and "," in braces.group(1) and ".." not in braces.group(1):
        head, tail = path[: braces.start()], path[braces.end() :]
        return [n for part in braces.group(1).split(",") for n in _expand(head + part + tail)]
    return [re.sub(r"\{[^}]*\}|<[^>]*>|\$\([^)]*\)", "*", path)]


def _exists(path: str) -> bool:
    path = path.rstrip(".")
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_every_recording_path_the_docs_name_exists() -> None:
    missing = []
    for doc in _docs():
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for mention in MENTION.findall(line):
                gone = [p for p in _expand(mention) if not _exists(p)]
                missing += [f"{doc.name}:{line_no}: {p}" for p in gone]
    assert not missing, "\n".join(missing)
