"""No import cycle anywhere in the package (``bridge/``, ``bridge/sim/``, ``bridge/platform/``
and ``bridge/job/recorder/`` included).

Every import counts, at module level, under ``if TYPE_CHECKING:`` or inside a function:
a cycle that only a type hint or a late import hides is still two modules that cannot
be understood, changed or tested one without the other. A collaborator's type comes
from a ``Protocol`` beside its user, or from a leaf module (``bridge/job/reports/kinds.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import bridge

PACKAGE = Path(bridge.__file__).resolve().parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` by its dotted name (a package by its own name)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (package, *path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its text. ``from P import
    x`` is an import of ``P.x`` when that is a module, else of ``P``."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return {module for module in found if module in modules and module != name}


def cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in sorted(graph[node]):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_the_package_has_no_import_cycle() -> None:
    modules = module_names(PACKAGE, "bridge")
    assert {"bridge.sim.clusterd", "bridge.platform.agent", "bridge.job.recorder.cycles", "bridge.job.reports.ledger"} <= set(modules)
    assert cycles(modules) == []


def test_a_cycle_only_a_type_hint_or_a_late_import_makes_is_found(tmp_path: Path) -> None:
    """The check can fail: a TYPE_CHECKING import and an import inside a function each
    close a cycle; a package importing its own submodule by ``from . import`` does not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import a\n")
    (package / "a.py").write_text("from .b import B\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("def f():\n    from ..sub import d\n")
    (package / "sub" / "d.py").write_text("from pkg.sub.c import f\n")
    assert cycles(module_names(package, "pkg")) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
