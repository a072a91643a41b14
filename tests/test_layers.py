"""The import layers, read from the source with ``ast`` (nothing is imported, no process starts).

The notebook's kernel must never load torch (CUDA would start in a process that holds no rank) nor
the rank side; a rank must never load the notebook side. Every import that runs counts, at module
level or inside a function (tests/_imports.py says which run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from _imports import imports, modules

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
    "distlab.byte_text",  # bytes and bytes/s as text: the dashboard's and a healing record's
    "distlab.version",  # the package's version: the face re-exports it, a checkpoint records it
    "distlab.ipycompat_engine",  # an engine's own privates (its connection file, control channel): on the ranks
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
    "distlab.front",  # the Lab with its views, and the magics: above every other package of the notebook's
    "distlab.notebook",
    "distlab.dashboard",
    "distlab.server",
    "distlab.quiz",
    "distlab.exercises",
    "distlab.cluster",
    "distlab.scale",  # plans, predictions and the dry run's launcher; the dry run itself is its own process
    "distlab.progress_file",  # the learner's progress file: the quiz and the exercises' checks write it
    "distlab.classroom",  # the hub's process and its service, and the class's limits read in the kernel
    "distlab.ipycompat_plotly",  # plotly's widget bundle, shared by the dashboard's figures
)
#: The package itself: ``import distlab`` is lazy (PEP 562), and its magics are the notebook's.
ROOT = "distlab"
#: An exercise's grader runs on the ranks: ``exercises/<name>/grader.py``, and the modules of its own
#: folder it imports (atomic-checkpoint's saving process and states).
EXERCISES, GRADER = "distlab.exercises", "grader"
#: Third-party packages the notebook side must not load.
NOTEBOOK_NEVER_LOADS = ("torch",)

#: Each package directly under distlab, and its side; a package inside one is of its side. A module of
#: a package can be another side's only by a prefix above naming it (the glue, a grader, the shared).
PACKAGES = {
    "distlab.checkpoint": "rank",
    "distlab.classroom": "notebook",
    "distlab.cluster": "notebook",
    "distlab.dashboard": "notebook",
    "distlab.exercises": "notebook",
    "distlab.front": "notebook",
    "distlab.nn": "rank",
    "distlab.notebook": "notebook",
    "distlab.quiz": "notebook",
    "distlab.rank": "rank",
    "distlab.scale": "notebook",
    "distlab.server": "notebook",
    "distlab.telemetry": "rank",
    "distlab.theory": "shared",
}

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
        todo += [name for _, name in imports(module, known[module], known)
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
    known = modules(package_dir)
    graders = _grader_modules(known)
    found = []
    for module, path in known.items():
        mine = layer_of(module, graders)
        if mine == "unknown":
            found.append(Violation(module, 1, "-", "no layer names it: add its prefix to tests/test_layers.py"))
            continue
        for line, name in imports(module, path, known):
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
    known = modules(Path(distlab.__file__).parent)
    stale = [p for p in (*SHARED, *RANK, *GLUE, *NOTEBOOK, EXERCISES) if not any(_prefixed(m, p) for m in known)]
    assert not stale, f"rules naming no module: {stale}"
    assert _grader_modules(known), "no grader found"


def _package_of(module: str) -> str | None:
    """The package directly under distlab that holds ``module``; None for a module of distlab itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or f"{parts[0]}.{parts[-1]}" in PACKAGES else None


def test_each_package_has_its_side_and_the_prefixes_agree():
    known = modules(Path(distlab.__file__).parent)
    packages = {module for module, path in known.items() if path.name == "__init__.py" and module.count(".") == 1}
    assert sorted(packages - set(PACKAGES)) == [], "give each new package its side in PACKAGES and the prefixes"
    assert sorted(set(PACKAGES) - packages) == [], "PACKAGES names packages that are gone"
    graders = _grader_modules(known)
    assert {package: layer_of(package, graders) for package in PACKAGES} == PACKAGES


def package_crossings(package_dir: Path) -> list[str]:
    """Each package that imports a package of a side its own must not import: counted from the modules
    that are of their package's side (a grader, the glue, a shared module inside a package cross by
    design, and the module check holds them)."""
    known = modules(package_dir)
    graders = _grader_modules(known)
    found = set()
    for module, path in known.items():
        package = _package_of(module)
        if package not in PACKAGES or layer_of(module, graders) != PACKAGES[package]:
            continue  # a module of distlab itself, a package with no side yet (the test above says so)
        for _, name in imports(module, path, known):
            theirs = _package_of(name) if _prefixed(name, ROOT) else None
            if theirs not in PACKAGES or theirs == package or layer_of(name, graders) != PACKAGES[theirs]:
                continue
            if PACKAGES[theirs] in FORBIDDEN[PACKAGES[package]]:
                found.add(f"{package} ({PACKAGES[package]}) imports {theirs} ({PACKAGES[theirs]}) in {module}")
    return sorted(found)


def test_no_package_imports_a_package_of_a_side_it_must_not():
    found = package_crossings(Path(distlab.__file__).parent)
    assert not found, "packages across the sides:\n" + "\n".join(found)


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
}


def test_the_checker_passes_a_clean_package(tmp_path):
    assert violations(_plant(tmp_path, _CLEAN)) == []


@pytest.mark.parametrize(
    "name, text, expected",
    [
        # torch in a function of the notebook side still loads it in the kernel
        ("front/lab.py", "def f():\n    import torch.distributed\n", "front.lab:2 imports torch.distributed"),
        ("front/lab.py", "from ..rank import group\n", "distlab.front.lab:1 imports distlab.rank.group"),
        ("dashboard/view.py", "from distlab.telemetry import watch\n", "imports distlab.telemetry"),
        ("rank/cell.py", "def f():\n    from ..notebook import lab\n", "rank.cell:2 imports distlab.notebook (the"),
        ("wire.py", "import torch\n", "distlab.wire:1 imports torch (the shared side never imports torch)"),
        ("rank/dispatch.py", "from . import group\n", "distlab.rank.dispatch:1 imports distlab.rank.group"),
        # an exercise's task is the notebook's; only its grader and what the grader imports are the rank's
        ("exercises/ring/task.py", "import torch\n", "distlab.exercises.ring.task:1 imports torch"),
        ("exercises/ring/grader.py", "from ...notebook import lab\n", "distlab.exercises.ring.grader:1 imports"),
        ("exercises/ring/states.py", "from .. import grading\n", "imports distlab.exercises.grading (the rank side"),
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


def test_the_package_check_finds_a_planted_crossing_and_passes_a_clean_package(tmp_path):
    assert package_crossings(_plant(tmp_path / "clean", _CLEAN)) == []
    files = {**_CLEAN, "dashboard/view.py": "def f():\n    from ..telemetry import watch\n", "telemetry/watch.py": ""}
    assert package_crossings(_plant(tmp_path / "crossing", files)) == [
        "distlab.dashboard (notebook) imports distlab.telemetry (rank) in distlab.dashboard.view"
    ]


# --- No circle: the packages (and the modules) stand in an order, each importing only those below it. ---


def _node(module: str, level: str) -> str:
    """What ``module`` counts as: itself (``level="module"``), or its package directly under distlab, a
    module of distlab itself (``distlab.wire``) and the package ``distlab`` being their own."""
    return module if level == "module" else ".".join(module.split(".")[:2])


def import_circles(package_dir: Path, level: str) -> list[str]:
    """Each circle of imports between ``level``s ("package" or "module") of ``package_dir``, one line each:
    its members, then every import that joins two of them (``module:line imports name``). Every import
    counts: at module level, in a function, and under ``if TYPE_CHECKING:`` (one never run still couples
    the two: neither can move, be read or be tested without the other)."""
    known = modules(package_dir)
    edges: dict[str, dict[str, set[str]]] = {_node(module, level): {} for module in known}
    for module, path in known.items():
        mine = _node(module, level)
        for line, name in imports(module, path, known, type_checking=True):
            if _prefixed(name, ROOT) and name != ROOT and _node(name, level) != mine:
                edges[mine].setdefault(_node(name, level), set()).add(f"{module}:{line} imports {name}")

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for after in edges.get(todo.pop(), {}):
                if after not in seen:
                    seen.add(after)
                    todo.append(after)
        return seen

    below = {node: reach(node) for node in edges}
    circles = {frozenset(n for n in below[node] if node in below[n]) for node in edges if node in below[node]}
    return sorted(
        " <-> ".join(sorted(circle)) + ": " + "; ".join(
            why for node in sorted(circle) for after, whys in sorted(edges[node].items()) if after in circle
            for why in sorted(whys))
        for circle in circles
    )


@pytest.mark.parametrize("level", ["package", "module"])
def test_no_two_packages_or_modules_import_each_other_even_through_others_or_for_types(level):
    # A view imports the lab's core (notebook/); the Lab that attaches the views (front/) imports them.
    # A back-import, even type-only, closes a circle: name what is read in a Protocol of the lower
    # module instead (notebook/observers.py ObservedLab, dashboard/autoshow.py WatchedLab).
    found = import_circles(Path(distlab.__file__).parent, level)
    assert not found, f"{level}s importing each other:\n" + "\n".join(found)


def test_the_circle_check_finds_a_planted_back_import_even_for_a_type(tmp_path):
    files = {**_CLEAN, "notebook/core.py": "", "dashboard/view.py": "from ..notebook import core\n"}
    assert import_circles(_plant(tmp_path / "clean", files), "package") == []
    assert import_circles(_plant(tmp_path / "clean", files), "module") == []
    files["notebook/core.py"] = (  # a type-only back-import: it never runs, and still closes the circle
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..dashboard import view\n"
    )
    expected = ("distlab.dashboard.view:1 imports distlab.notebook.core; "
                "distlab.notebook.core:3 imports distlab.dashboard.view")
    assert import_circles(_plant(tmp_path / "back", files), "package") == [
        f"distlab.dashboard <-> distlab.notebook: {expected}"
    ]
    assert import_circles(_plant(tmp_path / "back", files), "module") == [
        f"distlab.dashboard.view <-> distlab.notebook.core: {expected}"
    ]


# --- ARCHITECTURE.md's table of packages, held to the tree. ----------------------------------------------

ARCHITECTURE = Path(distlab.__file__).parent.parent / "ARCHITECTURE.md"


def architecture_rows(text: str) -> dict[str, str]:
    """``{'distlab/x/' or 'distlab/y.py': side}`` from the table under "## Every package"."""
    section = text.split("## Every package", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`distlab/"):
            for name in re.findall(r"`(distlab/[^`]+)`", cells[0]):
                rows[name] = cells[1]
    return rows


def test_architecture_names_every_package_and_top_level_module_with_its_side():
    package_dir = Path(distlab.__file__).parent
    rows = architecture_rows(ARCHITECTURE.read_text())
    present = {f"distlab/{p.name}/" for p in package_dir.iterdir() if (p / "__init__.py").exists()}
    present |= {f"distlab/{p.name}" for p in package_dir.glob("*.py")}
    assert sorted(present - set(rows)) == [], "name each in ARCHITECTURE.md's table, with its side and what it owns"
    assert sorted(set(rows) - present) == [], "ARCHITECTURE.md's table names what is gone"
    known = modules(package_dir)
    graders = _grader_modules(known)
    for name, side in rows.items():
        module = name.removesuffix("/").removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        found = layer_of(module, graders)
        assert found == side, f"{name}: ARCHITECTURE.md says {side}, the layers {found}"


def test_the_architecture_reader_sees_a_missing_package():
    text = ("## Every package\n\n| package | side | owns |\n|---|---|---|\n"
            "| `distlab/rank/`, `distlab/a.py` | rank | x |\n")
    assert architecture_rows(text) == {"distlab/rank/": "rank", "distlab/a.py": "rank"}
    assert "distlab/notebook/" not in architecture_rows(text)
