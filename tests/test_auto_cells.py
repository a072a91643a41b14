"""Auto mode's transformer: which cells go to the ranks as %%ddp cells and which stay on the notebook,
read through a real IPython shell's own input transformation (no lab: whether one runs is given)."""

from __future__ import annotations

import pytest
from IPython.core.inputtransformer2 import TransformerManager

from distlab.notebook.auto_cells import AutoCells


@pytest.fixture
def shell_of():
    def make(on: bool, running: bool = True) -> tuple[AutoCells, TransformerManager]:
        auto = AutoCells(lambda: running)
        auto.on = on
        manager = TransformerManager()
        manager.cleanup_transforms.insert(0, auto)  # where the extension puts it: before magics are read
        return auto, manager
    return make


def ran_as(manager: TransformerManager, cell: str) -> str:
    return manager.transform_cell(cell)


def test_a_plain_cell_runs_on_the_ranks_in_auto_mode_and_on_the_notebook_without(shell_of):
    _, on = shell_of(True)
    assert ran_as(on, "x = rank + 1\nprint(x)\n") == (
        "get_ipython().run_cell_magic('ddp', '--auto', 'x = rank + 1\\nprint(x)\\n')\n")
    _, off = shell_of(False)
    assert ran_as(off, "x = 1\n") == "x = 1\n"


@pytest.mark.parametrize("cell", [
    "%dist status\n", "%%time\nx = 1\n", "!ls\n", "?print\n", "# only a comment\n", "%%ddp -r 0\nx = 1\n",
    "\n%matplotlib inline\n",
])
def test_magics_shell_escapes_help_and_comments_stay_on_the_notebook(shell_of, cell):
    _, on = shell_of(True)
    assert "'--auto'" not in ran_as(on, cell)


def test_a_local_cell_runs_on_the_notebook_in_auto_mode_and_out_of_it(shell_of):
    for mode in (True, False):
        _, manager = shell_of(mode)
        assert ran_as(manager, "%%local\ny = 2\ny\n") == "y = 2\ny\n"


def test_with_no_lab_running_a_plain_cell_stays_on_the_notebook(shell_of):
    _, manager = shell_of(True, running=False)
    assert ran_as(manager, "x = 1\n") == "x = 1\n"
