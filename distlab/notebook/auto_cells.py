"""Every cell on the ranks (``%dist auto on``): a plain cell becomes a ``%%ddp`` cell before IPython runs it.

Pasting a tutorial script cell by cell is where learners start; writing ``%%ddp`` over each cell is
what they forget. In auto mode IPython's first input transformer (``input_transformers_cleanup``, run
before magics are read) puts ``%%ddp --auto`` over a plain cell. What stays on the notebook: a cell that
starts with a magic (``%dist``, ``%%time``, ...), a shell escape (``!ls``) or help (``?``), one that
holds only comments, and one that starts with ``%%local``, whose first line is then dropped (in and
out of auto mode alike, so a notebook written for auto mode runs without it).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["LOCAL", "AutoCells"]

LOCAL = "%%local"
_STAYS = ("%", "!", "?")


class AutoCells:
    """The transformer: ``on`` says whether plain cells go to the ranks; ``running()`` whether a lab is
    there to take them (a lab stopped in any way leaves the notebook's cells on the notebook)."""

    def __init__(self, running: Callable[[], bool]) -> None:
        self.on = False
        self._running = running

    def __call__(self, lines: list[str]) -> list[str]:
        code = [(i, line.strip()) for i, line in enumerate(lines) if line.strip() and not line.strip().startswith("#")]
        if not code:
            return lines
        first, text = code[0]
        if text == LOCAL or text.startswith(LOCAL + " "):
            return lines[:first] + lines[first + 1:]
        if not self.on or text.startswith(_STAYS):
            return lines
        if not self._running():
            self.on = False  # the lab stopped (%dist stop, an idle limit, lab.stop()): auto mode ends with it
            return lines
        return ["%%ddp --auto\n", *lines]
