"""The rank's runner, called in this process as a rank calls it: ``%dist run`` behaves as the fresh
process torchrun would start, and the end-of-cell hooks (``rank/cell.py``, ``rank/script.py``,
``rank/hooks.py``). Fast tier: no lab, no process started; ``tests/test_torchrun.py`` runs the same
on a real lab's ranks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distlab.rank import hooks
from distlab.rank.cell import run_script
from distlab.rank.namespace import user_namespace


def _run(script: Path) -> dict:
    return run_script(script.read_text(), str(script), [str(script)], 0)


def _project(root: Path, name: str, helper: str) -> Path:
    """``root/name/train.py`` importing ``root/name/runner_utils.py`` (whose NAME is ``helper``)."""
    folder = root / name
    folder.mkdir()
    (folder / "runner_utils.py").write_text(f"NAME = {helper!r}\n")
    script = folder / "train.py"
    script.write_text("import runner_utils\nrunner_seen = runner_utils.NAME\n")
    return script


@pytest.fixture(autouse=True)
def _forget_the_helpers():
    yield
    for name in [n for n in sys.modules if n.startswith("runner_")]:
        del sys.modules[name]
    user_namespace().pop("runner_seen", None)


def test_a_second_script_gets_its_own_folders_helper_module_not_the_firsts(tmp_path):
    first, second = _project(tmp_path, "a", "from a"), _project(tmp_path, "b", "from b")
    for script, expected in ((first, "from a"), (second, "from b"), (first, "from a")):
        assert _run(script) == {"value": None}
        assert user_namespace()["runner_seen"] == expected, script
    assert str(tmp_path / "a") not in sys.path and str(tmp_path / "b") not in sys.path  # as before the runs


def test_an_edited_helper_module_is_imported_afresh_by_the_next_run(tmp_path):
    script = _project(tmp_path, "a", "first")
    _run(script)
    (tmp_path / "a" / "runner_utils.py").write_text("NAME = 'edited since'\n")  # another size: no stale .pyc
    (tmp_path / "a" / "runner_new.py").write_text("X = 1\n")  # made since the folder was last read
    script.write_text("import runner_utils, runner_new\nrunner_seen = (runner_utils.NAME, runner_new.X)\n")
    assert _run(script) == {"value": None}
    assert user_namespace()["runner_seen"] == ("edited since", 1)


def test_modules_under_the_scripts_folder_but_found_elsewhere_stay_imported(tmp_path, monkeypatch):
    # A project folder holding its virtual environment: the environment's packages are not the script's.
    site = tmp_path / ".venv" / "site-packages"
    site.mkdir(parents=True)
    (site / "runner_installed.py").write_text("X = 1\n")
    (tmp_path / "runner_local.py").write_text("X = 2\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path))
    import runner_installed  # noqa: F401
    import runner_local  # noqa: F401

    from distlab.rank.script import drop_modules_from

    assert drop_modules_from([str(tmp_path)]) == ["runner_local"]
    assert "runner_installed" in sys.modules and "runner_local" not in sys.modules
    # distlab's own modules hold the rank's state: an editable install's folder keeps them
    distlab_root = os.path.dirname(os.path.dirname(sys.modules["distlab"].__file__))
    assert drop_modules_from([distlab_root]) == [] and "distlab.rank.cell" in sys.modules


def test_a_scripts_folder_missing_on_the_ranks_host_is_named_when_an_import_needs_it():
    path = "/nowhere/on/this/host/train.py"  # the notebook's path, on a host that lacks it
    reply = run_script("import runner_helpers\n", path, [path], 0)
    error = reply["error"]
    assert error["ename"] == "ModuleNotFoundError"
    assert error["evalue"].startswith(
        "No module named 'runner_helpers' (the script's folder /nowhere/on/this/host is not on this rank's host "
    )
    assert "copy the folder to the same path on every host" in error["evalue"] and "\n" not in error["evalue"]
    assert f'File "{path}", line 1, in <module>' in error["traceback"]
    assert "/nowhere/on/this/host" not in sys.path
    assert run_script("runner_seen = 'ran'\n", path, [path], 0) == {"value": None}  # needing none, it runs


def test_what_a_script_sets_in_torchruns_variables_ends_with_it(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "41234")
    monkeypatch.delenv("GROUP_RANK", raising=False)
    code = ("import os\nos.environ['MASTER_PORT'] = '12355'\nos.environ['GROUP_RANK'] = '3'\n"
            "os.environ['RUNNER_X'] = '1'\n")
    assert run_script(code, "/tmp/t.py", ["t.py"], 0) == {"value": None}
    assert os.environ["MASTER_PORT"] == "41234" and "GROUP_RANK" not in os.environ
    assert os.environ.pop("RUNNER_X") == "1"  # not torchrun's: as a cell's, it stays


def test_end_of_cell_hooks_run_in_the_order_registered_and_a_failing_one_stops_none(monkeypatch):
    monkeypatch.setattr(hooks, "_hooks", [])
    calls = []

    def first() -> None:
        calls.append("first")
        raise RuntimeError("a view's failure is not the cell's")

    @hooks.at_cell_end
    def second() -> None:
        calls.append("second")

    assert hooks.at_cell_end(first) is first
    hooks.at_cell_end(second)  # again (a module reloaded): still once, in its place
    assert run_script("x = 1\n", "/tmp/t.py", ["t.py"], 0) == {"value": None}
    assert calls == ["second", "first"]


def test_watches_and_progress_bars_register_their_flush_when_imported():
    import importlib

    progress, watch = (importlib.import_module(m) for m in ("distlab.rank.progress", "distlab.telemetry.watch"))
    assert progress.flush in hooks._hooks and watch.flush in hooks._hooks


def test_what_a_cells_statement_binds_is_read_from_its_source_outside_functions_and_if_asked_loops():
    import ast

    from distlab.rank.cell import _bound_names

    source = (
        "import os.path, numpy as np\n"
        "flat = train()\n"
        "a, (b, c) = 1, (2, 3)\n"
        "with open('f') as f:\n"
        "    for step in range(3):\n"
        "        loss = step\n"
        "    total: int = 0\n"
        "def helper(x):\n"
        "    inner = x\n"
        "squares = [k * k for k in range(3)]\n"
    )
    statements = ast.parse(source).body
    assert [_bound_names(s) for s in statements] == [
        ["os", "np"], ["flat"], ["a", "b", "c"], ["f", "step", "loss", "total"], ["helper"], ["squares"],
    ]
    # A replacement whose loop ended where the others' did ran that loop's earlier steps: what the
    # statement binds outside its loops is what it may lack.
    assert _bound_names(statements[3], in_loops=False) == ["f", "total"]
