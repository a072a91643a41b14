"""Client side: re-print each rank's output as it arrives, one line at a time, labelled by rank."""

from __future__ import annotations

import sys
from typing import TextIO


class RankPrinter:
    """Tracks how much of each rank's accumulated stdout/stderr has been printed.

    ipyparallel accumulates each engine's output in the AsyncResult's metadata; we print the new
    part, complete lines only (so "[rank 1] " never lands in the middle of rank 0's line), and
    the unfinished tail when the cell ends.
    """

    def __init__(self, label_width: int = 1) -> None:
        self._printed: dict[tuple[int, str], int] = {}
        self._width = label_width

    def feed(self, rank: int, name: str, text: str, final: bool = False) -> None:
        key = (rank, name)
        done = self._printed.get(key, 0)
        new = text[done:]
        if not new:
            return
        cut = len(new) if final else new.rfind("\n") + 1
        if cut <= 0:
            return
        self._printed[key] = done + cut
        stream: TextIO = sys.stderr if name == "stderr" else sys.stdout
        prefix = f"[rank {rank:>{self._width}}] "
        chunk = new[:cut]
        lines = chunk.splitlines()
        stream.write("".join(prefix + line + "\n" for line in lines))
        stream.flush()
