"""Where each rank is, now: its live frames, read from outside its process (``cluster.stacks``, py-spy).

:class:`StacksReader`, a lab's collaborator. ``lab.stacks()`` reads them on request, from any
thread: a cell that hangs keeps the notebook's thread, so a script's other thread, or the side panel,
asks. A cell stopped at its deadline or by Ctrl-C carries the stacks of the ranks still running,
read before they were stopped (``CellContext.stacks``): where a hang was, not where the stop left it.
"""

from __future__ import annotations

from .. import checks
from ..cluster import stacks as live
from ..errors import DistlabError
from ..wire import CELL_FILE
from .lab_world import LabWorld
from .processes import on_this_machine

__all__ = ["StacksReader"]

#: How long the stacks of a cell being stopped may take: py-spy read 4 ranks in 0.04 s here (RESULTS).
STOPPING_TIMEOUT_S = 5.0


class StacksReader:
    """Where the ranks of ``world`` are; the cells' runner says which cell runs (``remember_cell``)."""

    def __init__(self, world: LabWorld) -> None:
        self._world = world
        self._cell_source = ""  # the code of the cell running or run last ("" for a script)

    def remember_cell(self, code: str) -> None:
        """The code of the cell that runs now: its lines are shown in the stacks ("" for a script,
        whose frames name its file, which py-spy reads)."""
        self._cell_source = code

    def stacks(self, selected: list[int], native: bool = False, timeout: float = 10.0) -> live.Stacks:
        """The live frames of the ``selected`` ranks (``Lab.stacks`` says what they show)."""
        checks.flag("native", native)
        checks.positive("timeout", timeout, example="timeout=10")
        return self._read_stacks(selected, native, timeout)

    def _read_stacks(self, ranks: list[int], native: bool, timeout: float) -> live.Stacks:
        table = self._world.table
        here = {r: table[r].pid for r in ranks if on_this_machine(table[r])}
        source = _as_ranks_number_it(self._cell_source)
        taken = live.take(here, native, timeout, {CELL_FILE.format(rank=r): source for r in here})
        for r in ranks:
            if r not in here:
                taken.missing[r] = f"it runs on {table[r].host}: stacks are read on the lab's machine only"
        return taken

    def of_stopped(self, ranks: list[int]) -> str:
        """A note for a cell being stopped: where its ranks still running are (``CellContext.stacks``)."""
        try:
            taken = self._read_stacks(ranks, False, STOPPING_TIMEOUT_S)
        except DistlabError as exc:  # py-spy missing: the cell's error says how to get the stacks next time
            return f"where the ranks were is not shown: {exc}"
        return "where the ranks still running were when the cell was stopped (their live stacks):\n" + taken.text()


def _as_ranks_number_it(code: str) -> list[str]:
    """The cell's lines as its ranks number them: a rank runs it through IPython's transformer
    (``rank.cell``), which drops leading blank lines and rewrites magics, so line N there is line N
    of this, not of the code as typed."""
    if not code:
        return []
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(code).splitlines()
