"""The lab's breakpoints on collectives: what ``lab.pause``, ``step`` and ``cont`` check and say.

The cell runner (``cells.CellRunner``) holds a paused cell and talks to its ranks; this is the
lab's side of it: the arguments checked, the refusals, and the side panel told (through the bus)
whenever the world pauses, steps or goes on.
"""

from __future__ import annotations

from .. import checks
from .cell_context import RunResult
from .cells import CellRunner
from .observers import ObserverBus
from .pause import Pause, breakpoint_of


class Breakpoints:
    """Arms the next cell, and steps or continues the one held at a pause (``LabCore.pause``)."""

    def __init__(self, cells: CellRunner, bus: ObserverBus) -> None:
        self._cells = cells
        self._bus = bus

    def arm(self, at: int | None, op: str | None, group: str | None, line: int | None, timeout: float) -> None:
        self._cells.refuse_while_paused("arm another breakpoint")
        checks.positive("timeout", timeout, example="timeout=600")
        self._cells.pause(breakpoint_of(at, op, group, line, timeout))

    def disarm(self) -> None:
        self._cells.pause(None)

    @property
    def paused(self) -> Pause | None:
        return self._cells.paused

    def ran(self, result: RunResult) -> RunResult:
        """A cell's result, the side panel told when it stopped at a pause."""
        if result.paused is not None:
            self._bus.tell("changed")
        return result

    def step(self) -> Pause | None:
        try:
            return self._cells.step()
        finally:
            self._bus.tell("changed")  # paused elsewhere, or no longer

    def cont(self) -> RunResult:
        try:
            return self._cells.cont()
        finally:
            self._bus.tell("changed")
