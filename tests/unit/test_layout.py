"""The layout rules a newcomer can rely on, checked on the source.

- The import graph of dilococtl/ and trainer/ has no cycle (function-local imports included).
- No module of dilococtl/, trainer/ or bench/ is past MAX_LINES lines.
- Library code never imports the CLI (dilococtl/cli/): the CLI is a thin layer over the library.
- No module reaches into another module's private names (`from m import _x`, `m._x`) of the three
  packages: what crosses a module's edge is public, and named for it.

A cycle makes a module's meaning depend on which side is imported first and keeps the two halves
from being read, tested or changed apart. Imports under `if TYPE_CHECKING:` do not run and are
left out; so are imports by name at run time (importlib): dilococtl/cli/__init__.py registers its
command modules that way, and they import `app` back from it (typer's usual layout).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dilococtl", "trainer")
SOURCES = ("dilococtl", "trainer", "bench")
MAX_LINES = 600


def module_names(tops: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module under the folders `tops` by dotted name (bench scripts as bench.NAME)."""
    out = {}
    for top in tops:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    # importing a.b.c runs a.b.c; its packages' __init__ are not counted (they import their
    # submodules by design, as a typer app registers its commands)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, deterministic order)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    for start in sorted(g):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(g[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(g.get(nxt, ())))))
    return None


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_imports_are_read_from_function_bodies_and_relative_forms(tmp_path):
    known = {"p": tmp_path / "p" / "__init__.py", "p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py"}
    src = tmp_path / "a.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b\n"
                   "def f():\n    from . import b\n")
    assert imports_of("p.a", src, known) == {"p.b"}
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b\n")
    assert imports_of("p.a", src, known) == set()


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    g = {m: {d for d in deps if d.split(".")[0] == package} for m, deps in graph().items()
         if m.split(".")[0] == package}
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_across_the_two_halves():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_is_past_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in module_names(SOURCES).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines (split them by concept): {long}"


def cli_importers(mods: dict[str, Path]) -> list[str]:
    """Modules outside dilococtl.cli (and the package's __main__) that import dilococtl.cli."""
    bad = []
    for name, path in mods.items():
        if name.startswith("dilococtl.cli") or name == "dilococtl.__main__":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(n == "dilococtl.cli" or n.startswith("dilococtl.cli.") for n in names):
                bad.append(f"{name}:{node.lineno}")
    return bad


def test_library_code_never_imports_the_cli():
    bad = cli_importers(module_names(SOURCES))
    assert not bad, f"library code imports dilococtl.cli (move what it needs into the library): {bad}"


def private_reaches(name: str, path: Path, known: set[str]) -> list[str]:
    """`from m import _x` and `m._x` (m a module of ours bound by an import) in `name`'s source."""
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> our module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    bound[a.asname or a.name] = sub
                elif node.module in known and a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{name}:{node.lineno} from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                mod = ".".join([bound[base.id], *reversed(chain[1:])])
                if mod in known and mod != name:
                    found.append(f"{name}:{node.lineno} {mod}.{node.attr}")
    return found


def test_the_private_reach_finder_finds_both_forms(tmp_path):
    src = tmp_path / "a.py"
    src.write_text("import p.b\nfrom p import c\nfrom p.b import _x, y\nprint(p.b._z, c._w, c.v, y._own)\n")
    got = private_reaches("p.a", src, {"p", "p.b", "p.c", "p.a"})
    assert got == ["p.a:3 from p.b import _x", "p.a:4 p.b._z", "p.a:4 p.c._w"]


def test_no_module_reaches_into_another_modules_private_names():
    mods = module_names(SOURCES)
    bad = [hit for name, path in mods.items() for hit in private_reaches(name, path, set(mods))]
    assert not bad, f"private names used across modules (make them public, or move the code): {bad}"


def test_the_longest_first_schedule_names_modules_that_exist():
    from tests.conftest import LONGEST_FIRST

    assert [m for m in LONGEST_FIRST if not (ROOT / m).is_file()] == []
