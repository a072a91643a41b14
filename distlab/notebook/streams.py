"""Client side: re-print each rank's output as it arrives, one line at a time, labelled by rank;
show what a rank displays (HTML, images, Markdown, figures, tables, widgets) under its label."""

from __future__ import annotations

import sys
from typing import Any, TextIO

#: The MIME type of a displayed ipywidget: its model lives on the rank.
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class RankPrinter:
    """Tracks how much of each rank's accumulated stdout/stderr has been printed.

    ipyparallel accumulates each engine's output in the AsyncResult's metadata; we print the new
    part, complete lines only (so "[rank 1] " never lands in the middle of rank 0's line), and
    the unfinished tail when the cell ends.
    """

    def __init__(self, label_width: int = 1) -> None:
        self._printed: dict[tuple[int, str], int] = {}
        self._shown: dict[int, int] = {}
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
        prefix = self._label(rank) + " "
        chunk = new[:cut]
        lines = chunk.splitlines()
        stream.write("".join(prefix + line + "\n" for line in lines))
        stream.flush()

    def forget(self, rank: int) -> None:
        """A new process took rank ``rank``'s place: its output starts from nothing."""
        self._printed = {key: n for key, n in self._printed.items() if key[0] != rank}
        self._shown.pop(rank, None)

    def show(self, rank: int, outputs: list[dict[str, Any]]) -> None:
        """Display the rank's rich outputs not shown yet (ipyparallel's ``AsyncResult.outputs``), each
        under a ``[rank N]`` line.

        In a Jupyter kernel each goes out as the rank made it: the notebook renders HTML, images,
        Markdown, plotly figures and tables, and a widget made on the rank is live there, because
        ipyparallel relays the rank's widget messages to the kernel's front end. Elsewhere (a
        terminal, a script) nothing can render them: the text form is printed, and a widget says
        that it shows only in a notebook.
        """
        done = self._shown.get(rank, 0)
        new = outputs[done:]
        if not new:
            return
        self._shown[rank] = done + len(new)
        shell = _kernel_shell()
        for output in new:
            data = output.get("data", {})
            if shell is not None:
                sys.stdout.write(self._label(rank) + "\n")
                sys.stdout.flush()
                from IPython.display import publish_display_data

                publish_display_data(data, output.get("metadata") or {})
                continue
            text = data.get("text/plain", "")
            if WIDGET_MIME in data:
                text += "  (a widget made on the rank: it shows only in a Jupyter notebook)"
            sys.stdout.write("".join(f"{self._label(rank)} {line}\n" for line in (text.splitlines() or [""])))
            sys.stdout.flush()

    def _label(self, rank: int) -> str:
        return f"[rank {rank:>{self._width}}]"


def _kernel_shell() -> Any:
    """The IPython shell when this process is a Jupyter kernel (rich outputs render), else None."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None
