"""Private APIs of other packages only in the compatibility modules, read from the source with ``ast``.

ARCHITECTURE.md's rule: every private API of a package distlab depends on (torch, ipyparallel,
ipykernel, ipywidgets, ...) is used in a compatibility module (``COMPAT``), where each use checks the
release it runs on, so that a new release is checked against those files alone. This test reads every
other module of distlab and reports ``file:line`` and the name of each use it finds.

"Private" is a name that starts with one underscore (a dunder is not). "Foreign" is a third-party
package: a top-level module that is neither distlab nor in the standard library (whose underscore
names distlab uses, ``os._exit``, ``sys._getframe``, a named tuple's ``_replace``, are documented). A
module's attribute cannot always be typed from its source, so the rule is what can be told for sure,
each part of it sound on its own:

1. Imports: ``import pkg._x``, ``from pkg._x import y`` and ``from pkg import _x``, ``pkg`` foreign.
2. Names bound to something foreign: a name an import of a foreign module binds (``import torch``,
   ``import torch.distributed as dist``, ``from ipyparallel import Client``), and a name assigned an
   attribute chain rooted at one (``c10d = dist.distributed_c10d``) or looping over a tuple of them
   (``for module in (dist, c10d)``), anywhere in the file. Any
   ``._x`` reached from such a name, through attributes, calls and subscripts
   (``torch._C``, ``dist.distributed_c10d._world``, ``torch.ops.aten._foo``), is reported: what a
   foreign module hands out is foreign.
3. Objects that are foreign by name: ``._x`` on a name (or attribute) ``FOREIGN_OBJECTS`` lists,
   leading underscores aside (``client._build_targets``, ``self._view._socket``). distlab calls the
   ipyparallel and ipykernel objects it holds by these names; its own objects go by others.
4. Subclasses of a foreign class (a base rooted at a name of 2): the base is imported and asked.
   A method ``def _x`` the base also has overrides it, and ``self._x`` / ``cls._x`` /
   ``super()._x`` reach it, when the base has ``_x`` or when the class (with its bases in the same
   file) defines no ``_x`` of its own. ``DOCUMENTED`` lists the underscore names a package documents
   as the way to use it (ipywidgets' ``_view_name``, IPython's ``_repr_html_``).

What this cannot see: a foreign object under another name (a tensor's ``t._version`` after
``t = torch.ones(1)`` in a parameter), a foreign subclass's instance attribute its base sets only in
``__init__`` and that distlab also assigns. Those are left to review.

A second check: no module of distlab imports another's private name (``from ..cluster.launch import
_ipp_log``): a name another module needs is public, or the helper moves.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import distlab

#: The compatibility modules (paths relative to distlab/, fnmatch-free: exact names or a prefix + "*.py").
COMPAT = ("rank/torchcompat*.py", "ipycompat*.py")

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

#: Files another helper is restructuring now; their cross-module private imports are left to it.
#: Being removed: empty this list once that work lands (each file here must still exist).
CROSS_MODULE_ALLOWED = (
    "notebook/*",
    "dashboard/autoshow.py",
    "dashboard/healing.py",
    "dashboard/progress.py",
    "dashboard/progress_view.py",
    "dashboard/quorums.py",
    "server/registry.py",
    "classroom/limits.py",
)
#: The same files, for their uses of foreign privates (notebook/rpc.py's ``client._build_targets``,
#: ``view._socket``: ``ipycompat.engine_send_target`` is what it calls once that work lands).
#: Being removed, with CROSS_MODULE_ALLOWED.
FOREIGN_ALLOWED = ("notebook/rpc.py",)


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


def _matches(rel: str, patterns: tuple[str, ...]) -> bool:
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


def _sources(package_dir: Path) -> dict[str, str]:
    return {p.relative_to(package_dir).as_posix(): p.read_text() for p in sorted(package_dir.rglob("*.py"))}


def foreign_violations(package_dir: Path, allowed: tuple[str, ...] = FOREIGN_ALLOWED) -> list[Use]:
    return [use for rel, text in _sources(package_dir).items() if not _matches(rel, COMPAT + allowed)
            for use in foreign_uses(rel, text)]


def cross_module_violations(package_dir: Path, allowed: tuple[str, ...] = CROSS_MODULE_ALLOWED) -> list[Use]:
    sources = _sources(package_dir)
    modules = {".".join(["distlab", *Path(r).with_suffix("").parts]).removesuffix(".__init__") for r in sources}
    return [use for rel, text in sources.items() if not _matches(rel, allowed)
            for use in cross_module_private_imports(rel, text, modules)]


# --- The checks. -----------------------------------------------------------------------------------

PACKAGE = Path(distlab.__file__).parent


def test_no_private_api_of_another_package_is_used_outside_the_compatibility_modules():
    found = foreign_violations(PACKAGE)
    assert not found, ("private APIs of other packages, to be moved into a compatibility module "
                       f"({', '.join(COMPAT)}):\n" + "\n".join(map(str, found)))


def test_no_module_of_distlab_imports_another_modules_private_name():
    found = cross_module_violations(PACKAGE)
    assert not found, ("private names imported across modules (make the name public, or move the helper):\n"
                       + "\n".join(map(str, found)))


def test_every_allowed_file_and_compatibility_module_exists():
    # A pattern left behind by a move or a rename would silently stop excusing (or checking) anything.
    rels = list(_sources(PACKAGE))
    stale = [p for p in (*COMPAT, *CROSS_MODULE_ALLOWED, *FOREIGN_ALLOWED) if not any(_matches(r, (p,)) for r in rels)]
    assert not stale, f"patterns naming no file: {stale}"


# --- The checker against a planted package (as tests/test_layers.py plants one). ----------------------


def _plant(root: Path, files: dict[str, str]) -> Path:
    package_dir = root / "distlab"
    for name, text in files.items():
        path = package_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in package_dir.rglob("*.py")} | {package_dir}:
        (folder / "__init__.py").touch()
    return package_dir


_CLEAN = {
    # the compatibility modules may use any private API
    "rank/torchcompat.py": "import torch\nFLAG = torch._C._get_tracing_state\n",
    "ipycompat.py": "def f(client):\n    return client._build_targets(0)\n",
    # distlab's own privates, on a distlab class and on a subclass of a foreign class it defines
    "rank/group.py": "import threading\nimport torch\n\nclass Holder:\n    def __init__(self):\n"
                     "        self._lock = threading.Lock()\n\n    def f(self):\n        return self._lock\n\n"
                     "class Layer(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self._scale = 2.0\n\n    def _scaled(self, x):\n        return x * self._scale\n",
    # public torch names, a replaced public function, the standard library's documented underscore names
    "rank/cell.py": "import os\nimport sys\nimport torch.distributed as dist\n\ndef f():\n"
                    "    dist.send = print\n    sys._getframe(0)\n    os._exit(0)\n",
    # a package's private module, imported inside the package; a name imported from it
    "theory/_checks.py": "def count(x):\n    return x\n",
    "theory/batch.py": "from ._checks import count\nfrom . import _checks\n",
    "notebook/magics.py": "from .dist_args import _parser\n",  # allowed while the restructuring lasts
    "notebook/dist_args.py": "_parser = None\n",
}


def test_the_checkers_pass_a_clean_package(tmp_path):
    package_dir = _plant(tmp_path, _CLEAN)
    assert foreign_violations(package_dir, allowed=()) == []
    assert cross_module_violations(package_dir, allowed=("notebook/magics.py",)) == []


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("rank/cell.py", "import torch\nX = torch._C\n", "distlab/rank/cell.py:2 torch._C (a foreign module's"),
        ("rank/cell.py", "from torch.distributed.distributed_c10d import _world\n",
         "rank/cell.py:1 torch.distributed.distributed_c10d._world (imports a private name)"),
        ("rank/cell.py", "from torch.utils._pytree import tree_leaves\n", "torch.utils._pytree (imports from"),
        ("rank/cell.py", "import torch._dynamo\n", "rank/cell.py:1 torch._dynamo (imports a private module)"),
        ("rank/cell.py", "import torch.distributed as dist\nc10d = dist.distributed_c10d\nW = c10d._world\n",
         "rank/cell.py:3 c10d._world (a foreign module's private)"),
        ("rank/cell.py", "import torch\nA = torch.ops.aten\nF = A._scaled_dot_product_flash_attention\n",
         "rank/cell.py:3 A._scaled_dot_product_flash_attention"),
        ("rank/cell.py", "import torch.distributed.distributed_c10d as c10d\nimport torch.distributed as dist\n"
                         "for module in (dist, c10d):\n    setattr(module, 'isend', print)\n",
         "rank/cell.py:4 module (replaces an internal module's function)"),
        ("cluster/view.py", "def send(client):\n    return client._build_targets(0)\n",
         "cluster/view.py:2 client._build_targets (a foreign object's private)"),
        ("cluster/view.py", "class Engine:\n    def __init__(self, lab):\n        self._view = lab.view\n"
                            "        self.socket = self._view._socket\n",
         "cluster/view.py:4 _view._socket (a foreign object's private)"),
        # overriding a foreign class's private, and calling one it has
        ("cluster/slurm.py", "from ipyparallel.cluster import launcher\n\n"
                             "class Slurm(launcher.SlurmEngineSetLauncher):\n    def _run_command(self, command):\n"
                             "        return ''\n",
         "cluster/slurm.py:4 ipyparallel.cluster.launcher.SlurmEngineSetLauncher._run_command (Slurm overrides"),
        ("cluster/forked.py", "from ipyparallel.cluster.launcher import LocalProcessLauncher\n\n"
                              "class Forked(LocalProcessLauncher):\n    def start(self):\n"
                              "        self._start_waiting()\n",
         "cluster/forked.py:5 ipyparallel.cluster.launcher.LocalProcessLauncher._start_waiting (Forked uses"),
        # a private the class reaches that it never defines, through a base in the same file
        ("rank/group.py", "import torch\n\nclass Base(torch.nn.Module):\n    pass\n\nclass Mine(Base):\n"
                          "    def f(self):\n        return self._made_up_by_torch\n",
         "rank/group.py:8 torch.nn.Module._made_up_by_torch (Mine uses its foreign base's private)"),
    ],
)
def test_the_foreign_checker_finds_a_planted_private_use(tmp_path, name, text, expected):
    files = dict(_CLEAN)
    files[name] = text
    found = [str(v) for v in foreign_violations(_plant(tmp_path, files), allowed=())]
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("cluster/kept.py", "from ..cluster.launch import _ipp_log\n",
         "distlab/cluster/kept.py:1 ..cluster.launch._ipp_log (another module's private name)"),
        ("rank/exercise.py", "from distlab.rank.cell import _handle\n", "rank/exercise.py:1 distlab.rank.cell._handle"),
        # a package's private module, from outside its package
        ("rank/exercise.py", "from ..theory._checks import count\n",
         "rank/exercise.py:1 ..theory._checks.count (a private module of distlab.theory)"),
        ("rank/exercise.py", "import distlab.theory._checks\n", "distlab.theory._checks (a private module of"),
        ("theory/batch.py", "from ._checks import _count\n", "theory/batch.py:1 ._checks._count (another module's"),
        # the allow-list excuses only what it names
        ("notebook/lab.py", "from ..rank.cell import _handle\n", "notebook/lab.py:1 ..rank.cell._handle"),
    ],
)
def test_the_cross_module_checker_finds_a_planted_private_import(tmp_path, name, text, expected):
    files = dict(_CLEAN)
    files[name] = text
    found = [str(v) for v in cross_module_violations(_plant(tmp_path, files), allowed=("notebook/magics.py",))]
    assert len(found) == 1 and expected in found[0], found
