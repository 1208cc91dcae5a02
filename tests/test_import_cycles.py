"""No import circle inside the engine or the router, no product or bench code that
imports the test suite, no worker role that imports the other, and no worker that imports
the router.

The graph is read from the source with ``ast``, not by importing: every ``import`` counts,
at module level, inside a function, and under ``if TYPE_CHECKING:`` alike (a deferred or
type-only import is still a dependency a reader has to follow). An edge goes to the module
named, or to the submodule a ``from package import name`` names; importing a submodule
does not add an edge to its package's ``__init__``.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _product_folders() -> list[str]:
    """The folders installed as pdserve's Python subpackages: pyproject.toml's
    [tool.setuptools] package-dir, read here so that a new subpackage is checked too."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        folders = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    return [d for d in folders if (ROOT / d / "__init__.py").is_file()]


pytestmark = pytest.mark.unit


def _module_name(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    package = ["pdserve", *(p for p in folder.split("/") if p != "pdserve")]
    return ".".join([*package, *parts])


def _sources(folder: str) -> dict[str, Path]:
    return {_module_name(folder, p): p for p in sorted((ROOT / folder).rglob("*.py"))}


def _imported(path: Path, name: str) -> Iterator[str]:
    """Every module name an import in the file names (relative ones resolved), and for
    ``from X import y`` also ``X.y``, which is a module when y is a submodule."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(folder: str) -> dict[str, set[str]]:
    """Module → the modules of the same folder it imports."""
    sources = _sources(folder)
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        graph[name] = {m for m in _imported(path, name) if m in sources and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_circle_and_passes_a_chain() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_graph_reads_function_level_and_relative_imports(tmp_path: Path) -> None:
    source = "from . import b\ndef f():\n    from pdserve.router.c import x\n"
    module = tmp_path / "a.py"  # read as pdserve.router.a
    module.write_text(source)
    names = set(_imported(module, "pdserve.router.a"))
    assert {"pdserve.router.b", "pdserve.router.c"} <= names


def test_router_has_no_import_cycle() -> None:
    assert cycles(import_graph("router")) == []


def test_api_and_transport_do_not_import_each_other() -> None:
    graph = import_graph("router")
    for name, imports in graph.items():
        if name.startswith("pdserve.router.transport."):
            assert not [m for m in imports if m.startswith("pdserve.router.api")], name


def test_engine_has_no_import_cycle() -> None:
    assert cycles(import_graph("engine")) == []


def _imports_tests(folder: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in _imported(path, _module_name(folder, path)):
            if name == "tests" or name.startswith("tests."):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    return bad


def test_product_code_never_imports_tests() -> None:
    folders = _product_folders()
    assert {"pdserve", "engine", "router", "worker"} <= set(folders), folders
    assert [line for folder in folders for line in _imports_tests(folder)] == []


def test_bench_never_imports_tests() -> None:
    """bench shares fakes and loopback helpers with the suite through pdserve.testing."""
    assert _imports_tests("bench") == []


def _worker_imports(folder: str, prefixes: tuple[str, ...]) -> list[str]:
    lines = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in sorted(set(_imported(path, _module_name(folder, path)))):
            if name.startswith(prefixes):
                lines.append(f"{path.relative_to(ROOT)}: {name}")
    return lines


def test_no_worker_role_imports_the_other_and_the_core_imports_neither() -> None:
    """One worker core package (issue 45 move 3): worker/core/ holds both roles' core
    pieces; prefill_worker/ and decode_worker/ are the front ends, each its own."""
    assert _worker_imports("prefill_worker", ("pdserve.decode_worker",)) == []
    assert _worker_imports("decode_worker", ("pdserve.prefill_worker",)) == []
    roles = ("pdserve.prefill_worker", "pdserve.decode_worker")
    assert _worker_imports("worker", roles) == []


def test_no_worker_imports_the_router() -> None:
    """The decode worker's prefill chain calls prefill workers with the client the router
    uses, from pdserve/worker_calls/, which imports no router module either."""
    folders = ("worker", "prefill_worker", "decode_worker", "pdserve/worker_calls")
    found = [line for f in folders for line in _worker_imports(f, ("pdserve.router",))]
    assert found == []
