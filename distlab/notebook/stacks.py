"""Where each rank is, now: its live frames, read from outside its process (``cluster.stacks``, py-spy).

A part of :class:`distlab.notebook.core.LabCore`. ``lab.stacks()`` reads them on request, from any
thread: a cell that hangs keeps the notebook's thread, so a script's other thread, or the side panel,
asks. A cell stopped at its deadline or by Ctrl-C carries the stacks of the ranks still running,
read before they were stopped (``CellContext.stacks``): where a hang was, not where the stop left it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .. import checks
from ..cluster import stacks as live
from ..errors import DistlabError
from ..wire import CELL_FILE
from .world import RankInfo, RankTable

__all__ = ["ReadsStacks"]

#: How long the stacks of a cell being stopped may take: py-spy read 4 ranks in 0.04 s here (RESULTS).
STOPPING_TIMEOUT_S = 5.0


class ReadsStacks:
    """The stacks half of a lab (mixed into ``LabCore``, which holds the table and the cells)."""

    _cell_source: str  # the code of the cell running or run last ("" for a script)

    if TYPE_CHECKING:  # what LabCore provides

        @property
        def table(self) -> RankTable: ...
        def _require_running(self) -> None: ...
        def ranks(self, spec: str | int | Iterable[int] | None = None) -> list[int]: ...
        def _on_this_machine(self, info: RankInfo) -> bool: ...

    def stacks(
        self, ranks: str | int | Iterable[int] | None = None, native: bool = False, timeout: float = 10.0
    ) -> live.Stacks:
        """Every rank's live frames (the given ranks, all by default), read from outside its process:
        ``print(lab.stacks())``, ``%dist stacks``. Ranks with the same stack are shown once.

        It answers while a cell runs (call it from another thread, or the side panel's Stacks
        button) and from a rank stuck in a collective, which answers nothing itself. ``native=True``
        adds the C and C++ frames (torch's, gloo's; slower). Each stack is cut to the user's code;
        ``.text(all_threads=True)`` shows every thread. Ranks on another machine are named, not read.
        Needs py-spy (a dependency of distlab) and permission to trace the ranks (ptrace).
        """
        self._require_running()
        selected = self.ranks(ranks)
        checks.flag("native", native)
        checks.positive("timeout", timeout, example="timeout=10")
        return self._read_stacks(selected, native, timeout)

    def _read_stacks(self, ranks: list[int], native: bool, timeout: float) -> live.Stacks:
        table = self.table
        here = {r: table[r].pid for r in ranks if self._on_this_machine(table[r])}
        source = _as_ranks_number_it(self._cell_source)
        taken = live.take(here, native, timeout, {CELL_FILE.format(rank=r): source for r in here})
        for r in ranks:
            if r not in here:
                taken.missing[r] = f"it runs on {table[r].host}: stacks are read on the lab's machine only"
        return taken

    def _stacks_of_stopped(self, ranks: list[int]) -> str:
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
