"""The reader behind ``tests/test_private_apis.py``, whose docstring states the rule it applies: each
use of a third-party package's private name in a distlab module, and each import of another distlab
module's private name, found with ``ast`` (nothing of distlab is imported; a foreign class a distlab
class subclasses is, to ask it what it has).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DOCUMENTED", "FOREIGN_OBJECTS", "INTERNAL_MODULES", "Use", "cross_module_violations", "foreign_uses",
    "foreign_violations", "matches", "sources",
]

#: Names distlab gives the ipyparallel and ipykernel objects it holds (rule 3).
FOREIGN_OBJECTS = frozenset({"client", "view", "kernel", "launcher", "engine_set", "controller", "ipp_cluster",
                             "direct_view", "load_balanced_view", "session", "comm"})

#: Modules a package keeps for itself under public names, re-exported by a public one (rule 5).
INTERNAL_MODULES = frozenset({"torch.distributed.distributed_c10d"})

#: Underscore names a package documents as its public way in (rule 4 skips them).
DOCUMENTED = frozenset({
    # ipywidgets: a custom widget names its front-end model and view by these class attributes
    "_view_name", "_view_module", "_view_module_version", "_model_name", "_model_module", "_model_module_version",
    # anywidget: a widget's front end and style
    "_esm", "_css",
})
#: IPython's display protocol (``_repr_html_``, ``_repr_mimebundle_``, ...): documented.
_REPR = re.compile(r"_repr_\w+_$")


@dataclass(frozen=True)
class Use:
    path: str
    line: int
    name: str
    why: str

    def __str__(self) -> str:
        return f"distlab/{self.path}:{self.line} {self.name} ({self.why})"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _documented(name: str) -> bool:
    return name in DOCUMENTED or bool(_REPR.match(name))


_STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


def _foreign(module: str) -> bool:
    top = module.partition(".")[0]
    return bool(top) and top != "distlab" and top not in _STDLIB


def matches(rel: str, patterns: tuple[str, ...]) -> bool:
    """Whether a path in distlab/ is one of ``patterns``: a path, a folder's ``"notebook/*"``, or ``"rank/x*.py"``."""
    return any(rel == p or (p.endswith("*") and rel.startswith(p[:-1])) or
               (p.endswith("*.py") and rel.startswith(p[:-4]) and rel.endswith(".py")) for p in patterns)


def _root(node: ast.expr) -> tuple[ast.Name | None, list[str]]:
    """The name an expression is reached from through attributes, calls and subscripts, and the
    attributes on the way (outermost last)."""
    chain: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            break
    return (node if isinstance(node, ast.Name) else None), chain[::-1]


def _plain(node: ast.expr) -> bool:
    """Whether an expression is a name or attributes of one (no call, no subscript)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _names(target: ast.expr) -> list[ast.expr]:
    """The targets an assignment's target stands for (a tuple's elements, each)."""
    if isinstance(target, ast.Tuple | ast.List):
        return [name for element in target.elts for name in _names(element)]
    return [target]


def _foreign_names(tree: ast.Module) -> dict[str, str]:
    """Rule 2: {name: the dotted foreign path it is bound to} for the whole file."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name):
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        top = alias.name.partition(".")[0]
                        bound[top] = top
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _foreign(node.module):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    # Aliases (``c10d = dist.distributed_c10d``; ``for module in (dist, c10d)``), until no new one is found.

    def path_of(value: ast.expr) -> str | None:
        root, chain = _root(value)
        return ".".join([bound[root.id], *chain]) if root is not None and root.id in bound and _plain(value) \
            else None

    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            paths: list[str | None] = []
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                paths = [path_of(node.value)]
            elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple | ast.List):
                targets, paths = [node.target], [path_of(e) for e in node.iter.elts]
            known = [p for p in paths if p is not None]
            if not known:
                continue
            # A loop over several: the internal module among them, if one is (rule 5), else the first.
            path = next((p for p in known if p in INTERNAL_MODULES), known[0])
            for target in targets:
                if isinstance(target, ast.Name) and target.id not in bound:
                    bound[target.id] = path
                    changed = True
    return bound


def _resolve(dotted: str) -> Any:
    """The object at a dotted path (the longest importable module, then attributes); None if none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _defined_in(cls: ast.ClassDef) -> set[str]:
    """The names a distlab class defines: its body's functions and assignments, and ``self.x = ...``."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names.add(target.id)
    for node in ast.walk(cls):
        for written in (node.targets if isinstance(node, ast.Assign) else
                        [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []):
            for target in _names(written):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                        target.value.id in ("self", "cls"):
                    names.add(target.attr)
    return names


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def foreign_uses(rel: str, text: str) -> list[Use]:
    """Every private use of a foreign package in one module's source (``rel``: its path in distlab/)."""
    tree = ast.parse(text, filename=rel)
    bound = _foreign_names(tree)
    found: list[Use] = []
    # 1. imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name) and any(_private(p) for p in alias.name.split(".")):
                    found.append(Use(rel, node.lineno, alias.name, "imports a private module"))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _foreign(node.module):
            if any(_private(p) for p in node.module.split(".")):
                found.append(Use(rel, node.lineno, node.module, "imports from a private module"))
            for alias in node.names:
                if _private(alias.name):
                    found.append(Use(rel, node.lineno, f"{node.module}.{alias.name}", "imports a private name"))
    # 2. and 3. attributes of foreign names and of foreign objects by name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr) or _documented(node.attr):
            continue
        root, chain = _root(node.value)
        if root is not None and root.id in bound and root.id not in ("self", "cls"):
            if not any(_private(c) for c in chain):  # else reported at the chain's first private step
                name = ".".join([root.id, *chain, node.attr])
                found.append(Use(rel, node.lineno, name, "a foreign module's private"))
            continue
        holder = node.value.id if isinstance(node.value, ast.Name) else \
            node.value.attr if isinstance(node.value, ast.Attribute) else None
        if holder is not None and holder.lstrip("_") in FOREIGN_OBJECTS:
            found.append(Use(rel, node.lineno, f"{holder}.{node.attr}", "a foreign object's private"))
    # 5. replacing a function of a package's internal module: ``setattr(c10d, "isend", ...)``
    for node in ast.walk(tree):
        replaced: list[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args:
            replaced = [node.args[0]]
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for written in node.targets if isinstance(node, ast.Assign) else [node.target]:
                replaced += [t.value for t in _names(written) if isinstance(t, ast.Attribute)]
        for holder in replaced:
            root, chain = _root(holder)
            if root is not None and root.id in bound and _plain(holder) and \
                    ".".join([bound[root.id], *chain]) in INTERNAL_MODULES:
                name = ".".join([root.id, *chain])
                found.append(Use(rel, node.lineno, name, "replaces an internal module's function"))
    # 4. subclasses of foreign classes
    classes = {c.name: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}

    def foreign_bases(cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> tuple[list[str], set[str]]:
        """The dotted paths of a class's foreign bases, and the names it and its same-file bases define."""
        paths, defined = [], _defined_in(cls)
        for base in cls.bases:
            root, chain = _root(base)
            if root is None:
                continue
            if root.id in bound:
                paths.append(".".join([bound[root.id], *chain]))
            elif root.id in classes and not chain and root.id not in seen:
                more, names = foreign_bases(classes[root.id], seen | {cls.name})
                paths += more
                defined |= names
        return paths, defined

    for cls in classes.values():
        paths, defined = foreign_bases(cls)
        if not paths:
            continue
        bases = [(p, _resolve(p)) for p in paths]
        for path, obj in bases:
            if obj is None:
                found.append(Use(rel, cls.lineno, path, f"{cls.name}'s base, which this test could not import"))

        def owner(name: str, bases: list[tuple[str, Any]] = bases) -> str | None:
            return next((p for p, obj in bases if obj is not None and hasattr(obj, name)), None)

        for item in cls.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _private(item.name) and \
                    not _documented(item.name) and (base := owner(item.name)):
                found.append(Use(rel, item.lineno, f"{base}.{item.name}", f"{cls.name} overrides a foreign private"))
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not _documented(node.attr) and \
                    _is_self(node.value):
                base = owner(node.attr)
                if base is not None or node.attr not in defined:
                    found.append(Use(rel, node.lineno, f"{base or paths[0]}.{node.attr}",
                                     f"{cls.name} uses its foreign base's private"))
    return sorted(set(found), key=lambda u: (u.path, u.line, u.name))


def cross_module_private_imports(rel: str, text: str, modules: set[str]) -> list[Use]:
    """Each import in one module (``rel``: its path in distlab/) of another distlab module's private
    name (``from ..cluster.launch import _ipp_log``), or of a private module (``_checks``) from outside
    the package that holds it. ``modules``: the dotted names of distlab's modules."""
    parts = ["distlab", *rel.removesuffix(".py").split("/")]
    package = parts[:-1]  # a package's __init__ is in the package it names
    found = []

    def check(line: int, target: list[str], shown: str) -> None:
        for i, part in enumerate(target[1:], start=1):
            if not _private(part):
                continue
            if ".".join(target[: i + 1]) not in modules:
                found.append(Use(rel, line, shown, "another module's private name"))
                return
            if package[:i] != target[:i]:
                found.append(Use(rel, line, shown, f"a private module of {'.'.join(target[:i])}"))
                return
            # a private module of the importer's own package: what is imported from it may still be private

    for node in ast.walk(ast.parse(text, filename=rel)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif (node.module or "").partition(".")[0] == "distlab":
                base = node.module.split(".") if node.module else []
            else:
                continue
            source = "." * node.level + (node.module or "")
            for alias in node.names:
                shown = f"{source}.{alias.name}" if node.module else source + alias.name
                check(node.lineno, [*base, alias.name], shown)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] == "distlab":
                    check(node.lineno, alias.name.split("."), alias.name)
    return found


def sources(package_dir: Path) -> dict[str, str]:
    """Each module's text, by its path in ``package_dir`` ("rank/cell.py")."""
    return {p.relative_to(package_dir).as_posix(): p.read_text() for p in sorted(package_dir.rglob("*.py"))}


def foreign_violations(package_dir: Path, skipped: tuple[str, ...]) -> list[Use]:
    """:func:`foreign_uses` in every module of ``package_dir`` but those ``skipped`` (see :func:`matches`)."""
    return [use for rel, text in sources(package_dir).items() if not matches(rel, skipped)
            for use in foreign_uses(rel, text)]


def cross_module_violations(package_dir: Path, skipped: tuple[str, ...]) -> list[Use]:
    """:func:`cross_module_private_imports` in every module of ``package_dir`` but those ``skipped``."""
    texts = sources(package_dir)
    modules = {".".join(["distlab", *Path(r).with_suffix("").parts]).removesuffix(".__init__") for r in texts}
    return [use for rel, text in texts.items() if not matches(rel, skipped)
            for use in cross_module_private_imports(rel, text, modules)]
