"""What a module of a package imports, read from its source with ``ast``: nothing is imported, no process starts.

The rule for ``if TYPE_CHECKING:``, said once: an import under it never runs, so it loads nothing, and
what a process loads (the layers, tests/test_layers.py) leaves it out (its ``else`` branch runs, and
counts). What a module's source names, its coupling to another (the lab's core never names a view,
not even for a type), counts it too: ``type_checking=True``.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

__all__ = ["imports", "modules"]


def modules(package_dir: Path) -> dict[str, Path]:
    """Every module under ``package_dir``, by dotted name (a package by its ``__init__``)."""
    root = package_dir.name
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [root, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(
    module: str, path: Path, known: Mapping[str, Path], *, type_checking: bool = False
) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of each import in ``module`` (its source at ``path``), at module level or in a
    function, resolved against the modules in ``known``: ``from .a import b`` is ``pkg.a.b`` where that is a
    module, else ``pkg.a``. Those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the TYPE_CHECKING branch never runs; its else does
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append((node.lineno, name if name in known else base))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found
