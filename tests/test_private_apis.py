"""Private APIs of other packages only in the compatibility modules, read from the source with ``ast``.

ARCHITECTURE.md's rule: every private API of a package distlab depends on (torch, ipyparallel,
ipykernel, ipywidgets, ...) is used in a compatibility module (``COMPAT``), where each use checks the
release it runs on, so that a new release is checked against those files alone. This test reads every
other module of distlab (the reader is ``tests/_private_uses.py``) and reports ``file:line`` and the
name of each use it finds.

"Private" is a name that starts with one underscore (a dunder is not). "Foreign" is a third-party
package: a top-level module that is neither distlab nor in the standard library (whose underscore
names distlab uses, ``os._exit``, ``sys._getframe``, a named tuple's ``_replace``, are documented). A
module's attribute cannot always be typed from its source, so the rule is what can be told for sure,
each part of it sound on its own:

1. Imports: ``import pkg._x``, ``from pkg._x import y`` and ``from pkg import _x``, ``pkg`` foreign.
2. Names bound to something foreign: a name an import of a foreign module binds (``import torch``,
   ``import torch.distributed as dist``, ``from ipyparallel import Client``), a name assigned an
   attribute chain rooted at one (``c10d = dist.distributed_c10d``) and a loop's name over a tuple
   of them (``for module in (dist, c10d)``), anywhere in the file. Any ``._x`` reached from such a
   name, through attributes, calls and subscripts (``torch._C``, ``dist.distributed_c10d._world``,
   ``torch.ops.aten._foo``), is reported: what a foreign module hands out is foreign.
3. Objects that are foreign by name: ``._x`` on a name (or attribute) ``FOREIGN_OBJECTS`` lists,
   leading underscores aside (``client._build_targets``, ``self._view._socket``). distlab calls the
   ipyparallel and ipykernel objects it holds by these names; its own objects go by others.
4. Subclasses of a foreign class (a base rooted at a name of 2, or a class of the same file that
   has one): the base is imported and asked. A method ``def _x`` the base also has overrides it, and
   ``self._x`` / ``cls._x`` / ``super()._x`` reach it, when the base has ``_x`` or when the class
   (with its bases in the same file) defines no ``_x`` of its own. ``DOCUMENTED`` lists the
   underscore names a package documents as the way to use it (ipywidgets' ``_view_name``, IPython's
   ``_repr_html_``).
5. Replacing a function of a module a package keeps for itself under public names
   (``INTERNAL_MODULES``: torch's ``distributed_c10d``, which ``torch.distributed`` re-exports):
   ``setattr(c10d, "isend", f)`` or ``c10d.isend = f`` relies on how torch looks its functions up.
   Replacing a public module's function (``dist.send = f``) is not a private use.

``FOREIGN_OBJECTS``, ``DOCUMENTED`` and ``INTERNAL_MODULES`` are in ``tests/_private_uses.py``. What
this cannot see: a foreign object under another name (a tensor's ``t._version`` for a parameter
``t``), a private reached through ``getattr(x, "_name")``, a foreign subclass's instance attribute its
base sets only in ``__init__`` and that distlab also assigns. Those are left to review.

A second check: no module of distlab imports another module's private name (``from
..cluster.launch import ipp_log``), nor a private module (``_checks``) from outside the package that
holds it: a name another module needs is public, or the helper moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _private_uses import cross_module_violations, foreign_violations, matches, sources

import distlab

#: The compatibility modules, by their paths in distlab/ (``"x*.py"``: every module whose name starts so).
COMPAT = ("rank/torchcompat*.py", "ipycompat*.py", "cluster/torchftcompat*.py")

#: Files whose private uses are excused: none. (Kept as the place to name one, with the reason, should a
#: private use ever have no compatibility module to go to.)
CROSS_MODULE_ALLOWED: tuple[str, ...] = ()
FOREIGN_ALLOWED: tuple[str, ...] = ()


# --- The checks. -----------------------------------------------------------------------------------

PACKAGE = Path(distlab.__file__).parent


def test_no_private_api_of_another_package_is_used_outside_the_compatibility_modules():
    found = foreign_violations(PACKAGE, COMPAT + FOREIGN_ALLOWED)
    assert not found, ("private APIs of other packages, to be moved into a compatibility module "
                       f"({', '.join(COMPAT)}):\n" + "\n".join(map(str, found)))


def test_no_module_of_distlab_imports_another_modules_private_name():
    found = cross_module_violations(PACKAGE, CROSS_MODULE_ALLOWED)
    assert not found, ("private names imported across modules (make the name public, or move the helper):\n"
                       + "\n".join(map(str, found)))


def test_every_allowed_file_and_compatibility_module_exists():
    # A pattern left behind by a move or a rename would silently stop excusing (or checking) anything.
    rels = list(sources(PACKAGE))
    stale = [p for p in (*COMPAT, *CROSS_MODULE_ALLOWED, *FOREIGN_ALLOWED) if not any(matches(r, (p,)) for r in rels)]
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
    "notebook/magics.py": "from .dist_args import _parser\n",  # excused by the allow-list the test passes
    "notebook/dist_args.py": "_parser = None\n",
}


def test_the_checkers_pass_a_clean_package(tmp_path):
    package_dir = _plant(tmp_path, _CLEAN)
    assert foreign_violations(package_dir, COMPAT) == []
    assert cross_module_violations(package_dir, ("notebook/magics.py",)) == []


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
    found = [str(v) for v in foreign_violations(_plant(tmp_path, files), COMPAT)]
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
    found = [str(v) for v in cross_module_violations(_plant(tmp_path, files), ("notebook/magics.py",))]
    assert len(found) == 1 and expected in found[0], found
