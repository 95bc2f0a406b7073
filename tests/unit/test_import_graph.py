"""The import graph of dilococtl/ and trainer/ has no cycle (function-local imports included).

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


def module_names() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
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
