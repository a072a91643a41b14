"""The import layers, read from the source with ``ast`` (nothing is imported, no process starts).

The notebook's kernel must never load torch (CUDA would start in a process that holds no rank) nor
the rank side; a rank must never load the notebook side. Every import counts, at module level or
inside a function, except those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import distlab

# --- The layers, as data. A module's layer is that of the longest prefix below naming it. -------------

#: Only data or plain checks, imported by both sides: they import neither side, nor torch.
SHARED = (
    "distlab.wire",
    "distlab.errors",
    "distlab.records",
    "distlab.checks",
    "distlab.theory",
    "distlab.ipycompat",  # ipyparallel's, ipykernel's and ipywidgets' privates: kernel and engines alike
    "distlab.host",  # the machine's id, whether a pid runs: the ranks ask them too
    "distlab.ipycompat_launchers",  # ipyparallel's launchers' privates (cluster/'s own launchers subclass them)
    "distlab.ipycompat_widgets",  # ipywidgets' privates (the dashboard's widgets count their messages)
    "distlab.scale.plan",  # a plan and its checks: the notebook makes it, the dry run reads it
    "distlab.scale.models",  # the models' shapes: the notebook names them, the dry run builds them
)
#: What runs in a rank's process (an ipyparallel engine).
RANK = (
    "distlab.rank",
    "distlab.telemetry",
    "distlab.checkpoint",
    "distlab.nn",
)
#: In the rank package but imported by the notebook: it names rank modules as text, imports none.
GLUE = ("distlab.rank.dispatch",)
#: What runs in the notebook's kernel (or a script), and the Jupyter server.
NOTEBOOK = (
    "distlab.notebook",
    "distlab.dashboard",
    "distlab.server",
    "distlab.quiz",
    "distlab.exercises",
    "distlab.cluster",
    "distlab.scale",  # plans, predictions and the dry run's launcher; the dry run itself is its own process
    "distlab.progress_file",  # the learner's progress file: the quiz and the exercises' checks write it
    "distlab.classroom",  # the hub's process and its service, and the class's limits read in the kernel
)
#: The package itself: ``import distlab`` is lazy (PEP 562), and its magics are the notebook's.
ROOT = "distlab"
#: An exercise's grader runs on the ranks: ``exercises/<name>/grader.py``, and the modules of its own
#: folder it imports (atomic-checkpoint's saving process and states). The older layout,
#: ``rank/graders/<name>.py``, is rank side by its prefix.
EXERCISES, GRADER = "distlab.exercises", "grader"
#: Third-party packages the notebook side must not load.
NOTEBOOK_NEVER_LOADS = ("torch",)

# Who may import whom: a layer -> the layers (and third-party packages) it must not import.
FORBIDDEN = {
    "notebook": {"rank", *NOTEBOOK_NEVER_LOADS},
    "rank": {"notebook"},
    "shared": {"rank", "notebook", *NOTEBOOK_NEVER_LOADS},
    "glue": {"rank", "notebook", "shared", *NOTEBOOK_NEVER_LOADS},
}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported} ({self.why})"


def _modules(package_dir: Path) -> dict[str, Path]:
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


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of each import that runs, resolved against the modules in ``known``:
    ``from .a import b`` is ``pkg.a.b`` where that is a module, else ``pkg.a``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
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


def _prefixed(name: str, prefixes: tuple[str, ...] | str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in ((prefixes,) if isinstance(prefixes, str) else prefixes))


def _grader_modules(known: dict[str, Path]) -> set[str]:
    """Each exercise's grader.py and what it imports, transitively, from its own folder."""
    graders = {m for m in known if _prefixed(m, EXERCISES) and m.rpartition(".")[2] == GRADER}
    found, todo = set(), list(graders)
    while todo:
        module = todo.pop()
        if module in found:
            continue
        found.add(module)
        folder = module.rpartition(".")[0]
        todo += [name for _, name in _imports(module, known[module], known)
                 if name in known and name.rpartition(".")[0] == folder]
    return found


def layer_of(module: str, graders: set[str]) -> str | None:
    """'notebook', 'rank', 'shared' or 'glue' for a distlab module; None for a third-party one."""
    if module in graders:
        return "rank"
    if module == ROOT:
        return "notebook"
    candidates = [(p, layer) for layer, prefixes in
                  (("shared", SHARED), ("rank", RANK), ("glue", GLUE), ("notebook", NOTEBOOK))
                  for p in prefixes if _prefixed(module, p)]
    if candidates:
        return max(candidates, key=lambda c: len(c[0]))[1]
    return None if not _prefixed(module, ROOT) else "unknown"


def violations(package_dir: Path) -> list[Violation]:
    """Every import in ``package_dir`` that crosses a layer it must not, and every module no rule names."""
    known = _modules(package_dir)
    graders = _grader_modules(known)
    found = []
    for module, path in known.items():
        mine = layer_of(module, graders)
        if mine == "unknown":
            found.append(Violation(module, 1, "-", "no layer names it: add its prefix to tests/test_layers.py"))
            continue
        for line, name in _imports(module, path, known):
            if name == ROOT:
                continue  # `import distlab`: the lazy package, which every submodule's import runs anyway
            theirs = layer_of(name, graders)
            target = theirs if theirs is not None else name.partition(".")[0]
            if target in FORBIDDEN[mine]:
                found.append(Violation(module, line, name, f"the {mine} side never imports {target}"))
    return found


# --- The checks. -----------------------------------------------------------------------------------


def test_the_notebook_side_never_imports_torch_or_the_rank_side_and_the_rank_side_never_the_notebooks():
    package_dir = Path(distlab.__file__).parent
    found = violations(package_dir)
    assert not found, "imports across the layers:\n" + "\n".join(map(str, found))


def test_every_rule_names_a_module_that_exists():
    # A prefix left behind by a move would silently stop checking anything.
    known = _modules(Path(distlab.__file__).parent)
    stale = [p for p in (*SHARED, *RANK, *GLUE, *NOTEBOOK, EXERCISES) if not any(_prefixed(m, p) for m in known)]
    assert not stale, f"rules naming no module: {stale}"
    assert _grader_modules(known) or any(_prefixed(m, "distlab.rank.graders") for m in known), "no grader found"


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
    "wire.py": "import json\n",
    "theory/memory.py": "from .. import checks\n",
    "checks.py": "from .errors import LabUsageError\n",
    "errors.py": "",
    "rank/dispatch.py": "from importlib import import_module\n",
    "rank/group.py": "import torch\nfrom ..wire import json\n",
    "notebook/rpc.py": "from ..rank.dispatch import on_rank\nfrom typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    import torch\n",
    "exercises/ring/grader.py": "import torch\nfrom . import states\nfrom ...rank import group\n",
    "exercises/ring/states.py": "import torch\n",
    "exercises/ring/task.py": "TEXT = 'import torch'\n",
    "rank/graders/old.py": "import torch\n",
}


def test_the_checker_passes_a_clean_package_with_both_grader_layouts(tmp_path):
    assert violations(_plant(tmp_path, _CLEAN)) == []


@pytest.mark.parametrize(
    "name, text, expected",
    [
        # torch in a function of the notebook side still loads it in the kernel
        ("notebook/lab.py", "def f():\n    import torch.distributed\n", "notebook.lab:2 imports torch.distributed"),
        ("notebook/lab.py", "from ..rank import group\n", "distlab.notebook.lab:1 imports distlab.rank.group"),
        ("dashboard/view.py", "from distlab.telemetry import watch\n", "imports distlab.telemetry"),
        ("rank/cell.py", "def f():\n    from ..notebook import lab\n", "rank.cell:2 imports distlab.notebook (the"),
        ("wire.py", "import torch\n", "distlab.wire:1 imports torch (the shared side never imports torch)"),
        ("rank/dispatch.py", "from . import group\n", "distlab.rank.dispatch:1 imports distlab.rank.group"),
        # an exercise's task is the notebook's; only its grader and what the grader imports are the rank's
        ("exercises/ring/task.py", "import torch\n", "distlab.exercises.ring.task:1 imports torch"),
        ("exercises/ring/grader.py", "from ...notebook import lab\n", "distlab.exercises.ring.grader:1 imports"),
        ("exercises/ring/states.py", "from .. import grading\n", "imports distlab.exercises.grading (the rank side"),
        ("rank/graders/old.py", "from ...quiz import model\n", "distlab.rank.graders.old:1 imports distlab.quiz"),
        ("newpart.py", "", "distlab.newpart:1 imports - (no layer names it"),
    ],
)
def test_the_checker_finds_a_planted_violation(tmp_path, name, text, expected):
    files = dict(_CLEAN)
    files[name] = text + files.get(name, "")  # first, so the expected line numbers are the planted ones
    if name == "exercises/ring/states.py":
        files["exercises/grading.py"] = ""
    found = [str(v) for v in violations(_plant(tmp_path, files))]
    assert len(found) == 1 and expected in found[0], found
