"""How bench code finds its modules: with no ``sys.path`` edit, and never in tests/.

``python bench/NAME.py`` puts bench/ first on ``sys.path`` (Python does, for any script),
so a bench imports its siblings and bench/lib by bare name (``import serve``, ``from lib
import flags``) and pdserve from the venv it runs in. The tests find the same names through
pytest's ``pythonpath`` (pyproject.toml), and a test's child process through its
``PYTHONPATH``. So no file of bench/ edits ``sys.path``, and no test puts bench/ there.

Read from the source with ``ast``: an edit counts wherever it is (in a function too), and
what it adds is followed through the names the module binds it to.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.unit


def _test_module_names(tests: Path, bench: Path) -> set[str]:
    """The names a module under ``tests`` is imported by once its folder is on sys.path,
    less bench's own modules (``python bench/X.py`` puts bench/ first: those resolve there)."""
    own = {p.stem for p in bench.rglob("*.py")} | {p.name for p in bench.iterdir() if p.is_dir()}
    return {p.stem for p in tests.rglob("*.py") if p.stem != "__init__"} - own


def _bindings(tree: ast.AST) -> dict[str, list[ast.AST]]:
    """What each name of a module is assigned or looped over (``for sub in (...)``)."""
    bound: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for name in (n for t in targets for n in ast.walk(t)):
                if isinstance(name, ast.Name):
                    bound.setdefault(name.id, []).append(node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            for name in ast.walk(node.target):
                if isinstance(name, ast.Name):
                    bound.setdefault(name.id, []).append(node.iter)
    return bound


def _strings(node: ast.AST, bound: dict[str, list[ast.AST]], seen: set[str]) -> Iterator[str]:
    """The string constants an expression is built from, following the names it uses to
    what the module assigns them or loops them over (``for sub in ("tests/k8s",): ...``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            yield sub.value
        elif isinstance(sub, ast.Name) and sub.id not in seen:
            seen.add(sub.id)
            for value in bound.get(sub.id, []):
                yield from _strings(value, bound, seen)


def _sys_path_edits(tree: ast.AST) -> Iterator[ast.AST]:
    """What each ``sys.path`` edit (insert, append, extend, ``+=``, assignment) or
    ``site.addsitedir`` adds."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            call = f"{ast.unparse(node.func.value)}.{node.func.attr}"
            if call in ("sys.path.insert", "sys.path.append", "sys.path.extend", "site.addsitedir"):
                yield from node.args[-1:]  # insert's index is no path
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("sys.path") for t in targets):
                yield node.value


def path_edits(folder: Path, naming: str = "") -> list[str]:
    """Every ``sys.path`` edit of a folder's Python files (only those whose added path has
    a part ``naming``, when given), as ``file:line: sys.path gets WHAT``."""
    bad = []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        bound = _bindings(tree)
        for added in _sys_path_edits(tree):
            parts = {p for s in _strings(added, bound, set()) for p in PurePosixPath(s).parts}
            if not naming or naming in parts:
                where = path.relative_to(folder.parent)
                bad.append(f"{where}:{added.lineno}: sys.path gets {ast.unparse(added)}")
    return bad


def bench_reaches_into_tests(bench: Path, tests: Path) -> list[str]:
    """Bench files that put a folder under tests/ on sys.path, or import by bare name a
    module that lives under tests/ (``from test_lora_files import ...``, ``k8s_emulator``):
    the dodges that an import named ``tests.*`` alone does not show."""
    names = _test_module_names(tests, bench)
    bad = path_edits(bench, naming="tests")
    for path in sorted(bench.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(bench.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported = [node.module]
            else:
                continue
            bad += [
                f"{where}:{node.lineno}: imports {m} from tests/"
                for m in imported
                if m.partition(".")[0] in names
            ]
    return sorted(bad)


def test_bench_never_reaches_into_tests_by_path_or_bare_name() -> None:
    assert bench_reaches_into_tests(ROOT / "bench", ROOT / "tests") == []


def test_no_bench_file_edits_sys_path() -> None:
    assert path_edits(ROOT / "bench") == []


def test_no_test_puts_bench_on_sys_path() -> None:
    """pyproject's pytest ``pythonpath`` does, once for the whole suite."""
    assert path_edits(ROOT / "tests", naming="bench") == []


def _probe_tree(tmp_path: Path) -> Path:
    """A bench/ and tests/ with the forms bench/chaos_isolation.py and
    bench/operator_load.py used (issue 45), and a bench file that is clean."""
    (tmp_path / "tests" / "k8s").mkdir(parents=True)
    (tmp_path / "tests" / "k8s" / "k8s_emulator.py").write_text("")
    (tmp_path / "tests" / "test_probe.py").write_text("")
    bench = tmp_path / "bench"
    (bench / "lib").mkdir(parents=True)
    (bench / "ok.py").write_text("import yaml\nfrom lib import flags\n")
    (bench / "root.py").write_text("import sys\nsys.path.insert(0, str(ROOT))\nimport yaml\n")
    (bench / "loop.py").write_text(
        'for sub in ("", "tests/engine"):\n    sys.path.insert(0, str(ROOT / sub))\n'
        "def f():\n    from test_probe import probe\n"
    )
    (bench / "direct.py").write_text(
        'TESTS = ROOT / "tests"\nsys.path.append(str(TESTS / "k8s"))\n'
        "from k8s_emulator import ApiServer\n"
    )
    return bench


def test_the_checks_find_a_tests_path_a_bare_test_module_and_any_edit(tmp_path: Path) -> None:
    bench = _probe_tree(tmp_path)
    assert bench_reaches_into_tests(bench, tmp_path / "tests") == [
        "bench/direct.py:2: sys.path gets str(TESTS / 'k8s')",
        "bench/direct.py:3: imports k8s_emulator from tests/",
        "bench/loop.py:2: sys.path gets str(ROOT / sub)",
        "bench/loop.py:4: imports test_probe from tests/",
    ]
    assert path_edits(bench) == [
        "bench/direct.py:2: sys.path gets str(TESTS / 'k8s')",
        "bench/loop.py:2: sys.path gets str(ROOT / sub)",
        "bench/root.py:2: sys.path gets str(ROOT)",
    ]
    test = tmp_path / "tests" / "test_probe.py"
    test.write_text('BENCH = ROOT / "bench"\ndef f():\n    sys.path += [str(BENCH)]\n')
    assert path_edits(tmp_path / "tests", naming="bench") == [
        "tests/test_probe.py:3: sys.path gets [str(BENCH)]"
    ]
